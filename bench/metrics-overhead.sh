#!/usr/bin/env bash
# Cost of observability: the same ferrite-server build twice, taking turns under bench-serve's
# load. The baseline runs with --disable-log-stats and is never scraped; the other logs the stats
# line every second and has /metrics scraped every 100 ms (ten times a 1 s Prometheus interval).
# The two take turns in alternating order (quiet, observed, observed, quiet, ...; --repeat) and
# the pooled figures are compared. Prints throughput/latency ratios and the scrape latency under
# load.
#
#   [SCRAPE_MS=100] bench/metrics-overhead.sh [bench-serve flags; default: --concurrency 32 --repeat 4]
set -euo pipefail
source "$(dirname "$0")/common.sh"
[ $# -gt 0 ] || set -- --concurrency 32 --repeat 4
serve 18190 /tmp/bench-metrics-18190.log --disable-log-stats
wait_health 18190
serve 18191 /tmp/bench-metrics-18191.log --log-stats-interval 1
wait_health 18191

target/release/bench-serve --model default \
  --target "quiet=http://127.0.0.1:18190" --target "observed=http://127.0.0.1:18191" \
  --scrape observed --scrape-ms "${SCRAPE_MS:-100}" "$@"
echo "stats lines logged by the observed server: $(grep -c 'Avg prompt throughput' /tmp/bench-metrics-18191.log)"
