#!/usr/bin/env bash
# Serving benchmark: the same GGUF behind llama.cpp's llama-server (the baseline) and
# ferrite-server, driven in one run by bench-serve (streaming /v1/completions, temperature 0,
# ignore_eos, prompts that differ from the first token). Three scenarios, each printing
# ratios against llama.cpp, with both servers' peak resident memory per level:
#   standard  ~128-token prompts, 128 tokens out, concurrency 1, 8 and 32
#   chat      ~1,000-token prompts, 256 tokens out, concurrency 8
#   long      ~4,000-token prompts, 128 tokens out, concurrency 4 (attention-bound prefill)
# Both servers hold the same number of KV-cache tokens: llama-server's -c is ferrite-server's
# KV capacity (its default --kv-cache-memory, read from vllm:cache_config_info), split across
# as many slots as the scenario's concurrency, and raised if a slot would not fit a request.
# Each KV cache is a memory budget the operator picks, so resident memory is only comparable
# at equal capacity.
#
#   bench/serve.sh [--repeat N] [extra bench-serve flags]
#   SCENARIOS="standard chat long" (the default) picks scenarios.
#
# llama-server comes from LLAMA_SERVER, else scripts/build-llama-server.sh's output if built
# (see docs/benchmarks.md); without it only ferrite-server is measured.
set -euo pipefail
source "$(dirname "$0")/common.sh"

serve 18181 /tmp/bench-ferrite-server.log
ferrite_pid=${pids[-1]}
wait_health 18181
kv=$(kv_tokens 18181)
echo "ferrite-server's KV cache holds $kv tokens"

scenario() { # name, slots, tokens one request needs, bench-serve flags...
  local name=$1 slots=$2 need=$3
  shift 3
  echo "== $name"
  local targets=() ctx=$((kv > slots * need ? kv : slots * need))
  if have_llama; then
    start_llama 18180 "/tmp/bench-llama-server-$name.log" "$slots" "$ctx"
    echo "llama-server: --parallel $slots -c $ctx"
    targets+=(--target "llama.cpp=http://127.0.0.1:18180" --pid "llama.cpp=$llama_pid")
  fi
  targets+=(--target "ferrite=http://127.0.0.1:18181" --pid "ferrite=$ferrite_pid")
  # The servers take turns: only one is under load at any time.
  "$target"/release/bench-serve "${targets[@]}" --model default "$@" "${extra[@]}"
  if have_llama; then stop_llama; fi
}

extra=("$@")
for s in ${SCENARIOS:-standard chat long}; do
  case "$s" in
    standard) scenario standard 32 512 ;;
    chat) scenario chat 8 2048 --concurrency 8 --prompt-tokens 1000 --max-tokens 256 ;;
    long) scenario long 4 5120 --concurrency 4 --prompt-tokens 4000 --max-tokens 128 ;;
    *) echo "unknown scenario $s (standard, chat, long)" >&2; exit 1 ;;
  esac
done
