#!/usr/bin/env bash
# Prefix-cache benchmark: a multi-turn chat workload (16 conversations sharing a ~1,000-token
# system prompt, 4 turns each, concurrency 8) against ferrite-server with prefix caching (the
# baseline), ferrite-server with --no-enable-prefix-caching, and llama.cpp's llama-server with
# its prompt cache, in one run. Prints TTFT p50/p99, output tok/s, the hit rate, and TTFT ratios.
#
#   bench/prefix-cache.sh [--repeat N] [other bench-prefix-cache flags]
#
# llama-server comes from LLAMA_SERVER, else scripts/build-llama-server.sh's output if built;
# without it only the two ferrite-servers are measured.
set -euo pipefail
source "$(dirname "$0")/common.sh"

targets=()
serve 18181 /tmp/bench-prefix-ferrite.log
serve 18182 /tmp/bench-prefix-ferrite-nocache.log --no-enable-prefix-caching
wait_health 18181
wait_health 18182
targets+=(--target "ferrite=http://127.0.0.1:18181" --target "ferrite-no-cache=http://127.0.0.1:18182")
if have_llama; then
  # 8 slots of 4,096 tokens (-c is split across --parallel slots); the prompt cache is on by
  # default (slots keep their last prompt, plus --cache-ram in host memory).
  start_llama 18180 /tmp/bench-prefix-llama-server.log 8 32768
  targets+=(--target "llama.cpp=http://127.0.0.1:18180")
fi
"$target"/release/bench-prefix-cache "${targets[@]}" --model default "$@"
