#!/usr/bin/env bash
# Serving benchmark: the same GGUF behind llama.cpp's llama-server (the baseline) and
# ferrite-server, driven in one run by bench-serve (streaming /v1/completions, temperature 0,
# ignore_eos, prompts that differ from the first token). Three scenarios, each printing
# ratios against llama.cpp:
#   standard  ~128-token prompts, 128 tokens out, concurrency 1, 8 and 32
#   chat      ~1,000-token prompts, 256 tokens out, concurrency 8
#   long      ~4,000-token prompts, 128 tokens out, concurrency 4 (attention-bound prefill)
# llama-server gets as many slots as the scenario's concurrency, each large enough for its
# requests (-c is split across --parallel slots).
#
#   bench/serve.sh [--repeat N] [extra bench-serve flags]
#   SCENARIOS="standard chat long" (the default) picks scenarios.
#
# llama-server comes from LLAMA_SERVER, else scripts/build-llama-server.sh's output if built
# (see docs/benchmarks.md); without it only ferrite-server is measured.
set -euo pipefail
source "$(dirname "$0")/common.sh"
threads="${THREADS:-$(nproc)}"
llama="${LLAMA_SERVER:-${LLAMA_CPP_DIR:-$HOME/.cache/ferrite/llama.cpp}/bin/llama-server}"

serve 18181 /tmp/bench-ferrite-server.log
wait_health 18181

scenario() { # name, llama slots, llama context, bench-serve flags...
  local name=$1 slots=$2 ctx=$3 llama_pid=
  shift 3
  echo "== $name"
  local targets=()
  if [ -x "$llama" ]; then
    "$llama" -m "$model" --host 127.0.0.1 --port 18180 --parallel "$slots" --cont-batching \
      -c "$ctx" -t "$threads" --log-disable >"/tmp/bench-llama-server-$name.log" 2>&1 &
    llama_pid=$!
    pids+=("$llama_pid")
    wait_health 18180
    targets+=(--target "llama.cpp=http://127.0.0.1:18180")
  fi
  targets+=(--target "ferrite=http://127.0.0.1:18181")
  # The servers take turns: only one is under load at any time.
  "$target"/release/bench-serve "${targets[@]}" --model default "$@" "${extra[@]}"
  if [ -n "$llama_pid" ]; then
    kill "$llama_pid"
    wait "$llama_pid" 2>/dev/null || true
  fi
}

extra=("$@")
for s in ${SCENARIOS:-standard chat long}; do
  case "$s" in
    standard) scenario standard 32 16384 ;;
    chat) scenario chat 8 16384 --concurrency 8 --prompt-tokens 1000 --max-tokens 256 ;;
    long) scenario long 4 20480 --concurrency 4 --prompt-tokens 4000 --max-tokens 128 ;;
    *) echo "unknown scenario $s (standard, chat, long)" >&2; exit 1 ;;
  esac
done
