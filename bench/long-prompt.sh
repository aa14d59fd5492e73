#!/usr/bin/env bash
# Long prompts against llama.cpp's llama-server, same run, same GGUF: one request at a time with
# prompts of ~512, ~1,900 and ~5,500 tokens and max_tokens 1, so TTFT is the prefill
# (llama-server with one 8,192-token slot). bench-serve alternates the targets (--repeat 2) and
# prints ratios against llama.cpp. Resident memory under load is bench/serve.sh's.
#
#   bench/long-prompt.sh          (LLAMA_SERVER, else scripts/build-llama-server.sh's output)
set -euo pipefail
source "$(dirname "$0")/common.sh"
have_llama || { echo "no llama-server: set LLAMA_SERVER or run scripts/build-llama-server.sh" >&2; exit 1; }

serve 18181 /tmp/bench-ferrite-server.log
wait_health 18181
start_llama 18180 /tmp/bench-llama-server.log 1 8192
echo "== prefill (max_tokens 1, concurrency 1)"
for n in 512 1896 5506; do
  echo "-- prompt ~$n tokens"
  "$target"/release/bench-serve --target "llama.cpp=http://127.0.0.1:18180" \
    --target "ferrite=http://127.0.0.1:18181" --model default --concurrency 1 --rounds 2 \
    --prompt-tokens "$n" --max-tokens 1 --repeat 2 | grep -E "c=1 |x "
done
