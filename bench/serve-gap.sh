#!/usr/bin/env bash
# The server against its own engine (issue 36): what share of the rate the model itself runs a
# closed-loop level's token mix at does ferrite-server deliver over HTTP?
#   engine: bench-runtime --mix-only (the same build's model and kernels, no HTTP, no
#           scheduler, no sampling beyond argmax): C prompts of P tokens prefilled in steps of
#           at most 2,048 tokens, then O - 1 decode steps of all C; output tokens / time is the
#           rate it predicts for the level.
#   server: bench-serve at concurrency C (P-token prompts, O tokens out, 2 rounds) against
#           ferrite-server with its defaults.
# REPEAT passes (default 2) alternate which of the two goes first; each prints both rates and
# their ratio, then the pooled ratio (served over predicted, summed over passes).
#
#   bench/serve-gap.sh [CONCURRENCY PROMPT OUTPUT]   (default 32 128 128)
set -euo pipefail
source "$(dirname "$0")/common.sh"
c=${1:-32} p=${2:-128} o=${3:-128}
engine() {
  "$target"/release/bench-runtime --model "$model" --mix-only --mix "$c,$p,$o" --reps 1 |
    sed -n 's/.*predicts \([0-9.]*\) output tok\/s.*/\1/p'
}
# A fresh server per pass: bench-serve sends the same prompts every time it starts, which a
# server that ran them before would find in its prefix cache.
server() {
  serve 18185 /tmp/bench-serve-gap-server.log
  wait_health 18185
  "$target"/release/bench-serve --target "ferrite=http://127.0.0.1:18185" --model default \
    --concurrency "$c" --prompt-tokens "$p" --max-tokens "$o" |
    sed -n "s/.*ferrite c=$c .*out tok\/s= *\([0-9.]*\).*/\1/p" | head -1
  stop_servers
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a / b }'; }
sum_e=0 sum_s=0
for i in $(seq 1 "${REPEAT:-2}"); do
  if (( i % 2 )); then e=$(engine); s=$(server); else s=$(server); e=$(engine); fi
  [ -n "$e" ] && [ -n "$s" ] || { echo "pass $i: no figure" >&2; exit 1; }
  echo "pass $i: engine predicts $e out tok/s, server delivers $s: $(ratio "$s" "$e")"
  sum_e=$(awk -v a="$sum_e" -v b="$e" 'BEGIN { print a + b }')
  sum_s=$(awk -v a="$sum_s" -v b="$s" 'BEGIN { print a + b }')
done
echo "pooled: server / engine = $(ratio "$sum_s" "$sum_e") (c=$c, $p-token prompts, $o out)"
