"""Prints the test executables in cargo's JSON messages (`cargo test --no-run --message-format
json | python3 scripts/test-executable.py`): scripts/test-avx2.sh and scripts/test-aarch64.sh
run the one they build under QEMU."""
import json
import sys

for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])
