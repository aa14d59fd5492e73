#!/usr/bin/env bash
# A/B of two ferrite-server builds under bench-serve's load: BASE_BIN (for example a build of an
# earlier commit: scripts/build-at.sh REV prints its path) is the baseline, this tree's release
# build the candidate, both with the same flags on the same model. Each of RUNS runs (default 4)
# starts both servers afresh; which starts first alternates every run and which is loaded first
# every two runs. The runs are pooled (bench-serve --pool) into ratios with their 95% interval.
#
#   BASE_BIN=$(scripts/build-at.sh REV) [RUNS=4] bench/ab.sh [bench-serve flags; default: --concurrency 1 --concurrency 8 --concurrency 32]
set -euo pipefail
source "$(dirname "$0")/common.sh"
[ -x "${BASE_BIN:-}" ] || { echo "set BASE_BIN to the baseline ferrite-server binary" >&2; exit 2; }
if cmp -s "$BASE_BIN" "$target/release/ferrite-server"; then
  echo "BASE_BIN is this tree's own build: nothing to compare" >&2
  exit 2
fi
[ $# -gt 0 ] || set -- --concurrency 1 --concurrency 8 --concurrency 32
runs=${RUNS:-4}
out=$(mktemp -d /tmp/bench-ab-XXXX)
for i in $(seq 1 "$runs"); do
  start_base() { SERVER_BIN="$BASE_BIN" serve 18192 "$out/base-$i.log"; wait_health 18192; }
  start_new() { serve 18193 "$out/new-$i.log"; wait_health 18193; }
  if (( i % 2 )); then start_base; start_new; else start_new; start_base; fi
  reverse=() order="in order"
  if (( (i - 1) / 2 % 2 )); then reverse=(--reverse) order="in reverse order"; fi
  echo "== run $i of $runs: started $( (( i % 2 )) && echo "base first" || echo "new first"), loaded $order"
  "$target"/release/bench-serve --model default \
    --target "base=http://127.0.0.1:18192" --target "new=http://127.0.0.1:18193" \
    "${reverse[@]}" --save "$out/run-$i.json" "$@"
  stop_servers
done
echo
"$target"/release/bench-serve --pool "$out"/run-*.json
