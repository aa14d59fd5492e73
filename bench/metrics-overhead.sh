#!/usr/bin/env bash
# Cost of observability: the same ferrite-server build twice under bench-serve's load. The
# baseline ("quiet") runs with --disable-log-stats and is never scraped; "observed" logs the
# stats line every second and has /metrics scraped every SCRAPE_MS (default 100 ms, ten times a
# 1 s Prometheus interval) from a thread of its own. Each of RUNS runs (default 8) starts both
# servers afresh; which starts first alternates every run and which is loaded first every two
# runs, so each order appears equally often. The runs are pooled (bench-serve --pool) into
# throughput/latency ratios and the scrape latency under load.
#
# AA=1 runs the same with two quiet servers and no scraping: the ratio it prints is the
# harness's own resolution, the noise a real difference must stand out from.
#
#   [RUNS=8] [SCRAPE_MS=100] [AA=1] bench/metrics-overhead.sh [bench-serve flags; default: --concurrency 32]
set -euo pipefail
source "$(dirname "$0")/common.sh"
[ $# -gt 0 ] || set -- --concurrency 32
runs=${RUNS:-8}
quiet=(--disable-log-stats)
if [ "${AA:-0}" = 1 ]; then
  name=quiet2 observed=(--disable-log-stats) scrape=()
else
  name=observed observed=(--log-stats-interval 1) scrape=(--scrape observed --scrape-ms "${SCRAPE_MS:-100}")
fi
out=$(mktemp -d /tmp/bench-metrics-XXXX)
for i in $(seq 1 "$runs"); do
  start_quiet() { serve 18190 "$out/quiet-$i.log" "${quiet[@]}"; wait_health 18190; }
  start_other() { serve 18191 "$out/$name-$i.log" "${observed[@]}"; wait_health 18191; }
  if (( i % 2 )); then start_quiet; start_other; else start_other; start_quiet; fi
  reverse=() order="in order"
  if (( (i - 1) / 2 % 2 )); then reverse=(--reverse) order="in reverse order"; fi
  echo "== run $i of $runs: started $( (( i % 2 )) && echo "quiet first" || echo "$name first"), loaded $order"
  "$target"/release/bench-serve --model default \
    --target "quiet=http://127.0.0.1:18190" --target "$name=http://127.0.0.1:18191" \
    "${scrape[@]}" "${reverse[@]}" --save "$out/run-$i.json" "$@"
  stop_servers
done
echo
"$target"/release/bench-serve --pool "$out"/run-*.json
[ "${AA:-0}" = 1 ] || echo "stats lines logged by the observed servers: $(cat "$out"/observed-*.log | grep -c 'Avg prompt throughput')"
