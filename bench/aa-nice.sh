#!/usr/bin/env bash
# A/A and compute-nice A/B: three ferrite-servers with --disable-log-stats, none scraped, started
# in this order: nice5a and nice5b (identical, --compute-nice 5) and nice0 (--compute-nice 0).
# bench-serve drives them in alternating order and prints ratios against nice5a. nice5b shows
# the harness's own spread between identical servers; nice0 shows what the renice costs.
#
#   bench/aa-nice.sh [bench-serve flags; default: --concurrency 32 --repeat 2]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
model="${FERRITE_MODEL:-$(scripts/fetch-model.sh)}"
cargo build --release -q -p ferrite-server -p ferrite-bench
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
[ $# -gt 0 ] || set -- --concurrency 32 --repeat 2
for spec in "18290 5" "18291 5" "18292 0"; do
  read -r port nice <<<"$spec"
  target/release/ferrite-server --model "$model" --host 127.0.0.1 --port "$port" \
    --served-model-name default --disable-log-stats --compute-nice "$nice" \
    >"/tmp/bench-aa-$port.log" 2>&1 &
  pids+=($!)
done
for port in 18290 18291 18292; do
  for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break; sleep 0.2; done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "server on $port did not become healthy" >&2; exit 1; }
done
target/release/bench-serve --model default --target nice5a=http://127.0.0.1:18290 \
  --target nice5b=http://127.0.0.1:18291 --target nice0=http://127.0.0.1:18292 "$@"
