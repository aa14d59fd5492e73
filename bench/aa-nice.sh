#!/usr/bin/env bash
# A/A and compute-nice A/B: three ferrite-servers with --disable-log-stats, none scraped, started
# in this order: nice5a and nice5b (identical, --compute-nice 5) and nice0 (--compute-nice 0).
# bench-serve drives them in alternating order and prints ratios against nice5a. nice5b shows
# the harness's own spread between identical servers; nice0 shows what the renice costs.
#
#   bench/aa-nice.sh [bench-serve flags; default: --concurrency 32 --repeat 2]
set -euo pipefail
source "$(dirname "$0")/common.sh"
[ $# -gt 0 ] || set -- --concurrency 32 --repeat 2
for spec in "18290 5" "18291 5" "18292 0"; do
  read -r port nice <<<"$spec"
  serve "$port" "/tmp/bench-aa-$port.log" --disable-log-stats --compute-nice "$nice"
done
for port in 18290 18291 18292; do wait_health "$port"; done
"$target"/release/bench-serve --model default --target nice5a=http://127.0.0.1:18290 \
  --target nice5b=http://127.0.0.1:18291 --target nice0=http://127.0.0.1:18292 "$@"
