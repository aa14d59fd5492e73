#!/usr/bin/env bash
# Serving benchmark: the same GGUF behind llama.cpp's llama-server (the baseline) and
# ferrite-server, driven in one run by bench-serve (streaming /v1/completions, ~128-token prompts,
# max_tokens 128, temperature 0, ignore_eos, concurrency 1, 8, 32). Prints ratios vs llama.cpp.
#
#   LLAMA_SERVER=/path/to/llama-server bench/serve.sh [extra bench-serve flags]
#
# llama-server is built from the llama.cpp vendored in PyPI llama-cpp-python's sdist; see
# docs/benchmarks.md. Without LLAMA_SERVER only ferrite-server is measured.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
model="${FERRITE_MODEL:-$(scripts/fetch-model.sh)}"
cargo build --release -q -p ferrite-server -p ferrite-bench
target=${CARGO_TARGET_DIR:-$root/target}
threads="${THREADS:-$(nproc)}"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

wait_health() {
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "server on port $1 did not become healthy" >&2; exit 1
}

targets=()
if [ -n "${LLAMA_SERVER:-}" ]; then
  # 32 slots of 512 tokens each (-c is split across --parallel slots).
  "$LLAMA_SERVER" -m "$model" --host 127.0.0.1 --port 18180 --parallel 32 --cont-batching \
    -c 16384 -t "$threads" --log-disable >/tmp/bench-llama-server.log 2>&1 &
  pids+=($!)
  wait_health 18180
  targets+=(--target "llama.cpp=http://127.0.0.1:18180")
fi
"$target"/release/ferrite-server --model "$model" --host 127.0.0.1 --port 18181 ${FERRITE_ARGS:-} \
  --served-model-name default >/tmp/bench-ferrite-server.log 2>&1 &
pids+=($!)
wait_health 18181
targets+=(--target "ferrite=http://127.0.0.1:18181")

# The servers take turns: only one is under load at any time.
"$target"/release/bench-serve "${targets[@]}" --model default "$@"
