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
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
model="${FERRITE_MODEL:-$(scripts/fetch-model.sh)}"
cargo build --release -q -p ferrite-server -p ferrite-bench
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

serve() { # port, extra flags...
  local port=$1; shift
  target/release/ferrite-server --model "$model" --host 127.0.0.1 --port "$port" \
    --served-model-name default ${FERRITE_ARGS:-} "$@" >"/tmp/bench-metrics-$port.log" 2>&1 &
  pids+=($!)
  wait_health "$port"
}
[ $# -gt 0 ] || set -- --concurrency 32 --repeat 4
serve 18190 --disable-log-stats
serve 18191 --log-stats-interval 1

target/release/bench-serve --model default \
  --target "quiet=http://127.0.0.1:18190" --target "observed=http://127.0.0.1:18191" \
  --scrape observed --scrape-ms "${SCRAPE_MS:-100}" "$@"
echo "stats lines logged by the observed server: $(grep -c 'Avg prompt throughput' /tmp/bench-metrics-18191.log)"
