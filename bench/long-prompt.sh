#!/usr/bin/env bash
# Long prompts and memory against llama.cpp's llama-server, same run, same GGUF:
#  1. prefill: one request at a time with prompts of ~512, ~1,900 and ~5,500 tokens and
#     max_tokens 1, so TTFT is the prefill (llama-server with one 8,192-token slot);
#  2. resident memory: peak VmRSS of each server, sampled every 0.5 s, while bench-serve drives it
#     at concurrency 32 (llama-server as in bench/serve.sh: 32 slots).
# bench-serve alternates the targets (--repeat 2) and prints ratios against llama.cpp.
#
#   bench/long-prompt.sh          (LLAMA_SERVER, else scripts/build-llama-server.sh's output)
set -euo pipefail
source "$(dirname "$0")/common.sh"
llama="${LLAMA_SERVER:-$HOME/.cache/ferrite/llama.cpp/bin/llama-server}"
[ -x "$llama" ] || { echo "no llama-server: set LLAMA_SERVER or run scripts/build-llama-server.sh" >&2; exit 1; }
threads="${THREADS:-$(nproc)}"

start_llama() { # slots, context
  "$llama" -m "$model" --host 127.0.0.1 --port 18180 --parallel "$1" --cont-batching -c "$2" \
    -t "$threads" --log-disable >/tmp/bench-llama-server.log 2>&1 &
  pids+=($!)
  llama_pid=$!
  wait_health 18180
}

targets=(--target "llama.cpp=http://127.0.0.1:18180" --target "ferrite=http://127.0.0.1:18181")
serve 18181 /tmp/bench-ferrite-server.log
ferrite_pid=${pids[-1]}
wait_health 18181

echo "== prefill (max_tokens 1, concurrency 1)"
start_llama 1 8192
for n in 512 1896 5506; do
  echo "-- prompt ~$n tokens"
  "$target"/release/bench-serve "${targets[@]}" --model default --concurrency 1 --rounds 2 \
    --prompt-tokens "$n" --max-tokens 1 --repeat 2 | grep -E "c=1 |x "
done
kill "$llama_pid"; wait "$llama_pid" 2>/dev/null || true

peak_rss() { # pid, until-pid: prints the peak VmRSS in MiB while until-pid runs
  local peak=0 r
  while kill -0 "$2" 2>/dev/null; do
    r=$(awk '/VmRSS/ {print $2}' "/proc/$1/status")
    [ "$r" -gt "$peak" ] && peak=$r
    sleep 0.5
  done
  echo $((peak / 1024))
}

echo "== peak RSS under concurrency 32 (128-token prompts, 128 tokens out)"
start_llama 32 16384
for name in llama.cpp ferrite; do
  if [ "$name" = ferrite ]; then pid=$ferrite_pid; port=18181; else pid=$llama_pid; port=18180; fi
  "$target"/release/bench-serve --target "$name=http://127.0.0.1:$port" --model default \
    --concurrency 32 --rounds 2 >/tmp/bench-rss-$name.log 2>&1 &
  load=$!
  echo "$name: idle $(( $(awk '/VmRSS/ {print $2}' /proc/$pid/status) / 1024 )) MiB, peak $(peak_rss "$pid" "$load") MiB"
  wait "$load"
done
