#!/usr/bin/env bash
# Regenerates docs/dashboards-{overview,realtime,autoscaling}.png. There is no Grafana here, so:
# runs the live dashboards test (tests/it/dashboards.rs: a real Prometheus scraping two
# loaded ferrite-servers and the operator) with FERRITE_DASHBOARD_PREVIEW_DIR set, so it saves
# every panel's query result; renders each dashboard's grid with those results as HTML
# (scripts/dashboard-preview.py); screenshots the pages with headless Chromium.
# Needs what scripts/test.sh needs, plus Chromium (installed with apt-get if missing).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export FERRITE_MODEL="${FERRITE_MODEL:-$(scripts/fetch-model.sh)}"
export FERRITE_TEST_PYTHON="${FERRITE_TEST_PYTHON:-$(scripts/python-env.sh)}"
export FERRITE_NODE_MODULES="${FERRITE_NODE_MODULES:-$(scripts/node-env.sh)}"
prom_dir="$(scripts/prometheus.sh)"
export FERRITE_PROMETHEUS="${FERRITE_PROMETHEUS:-$prom_dir/prometheus}"
export FERRITE_PROMTOOL="${FERRITE_PROMTOOL:-$prom_dir/promtool}"
if ! command -v chromium >/dev/null 2>&1; then
  apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends chromium >&2
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
FERRITE_DASHBOARD_PREVIEW_DIR="$work/data" cargo nextest run --workspace \
  -E 'package(ferrite-tests) & binary(it) & test(/^dashboards::every_panel_query/)' --no-capture
python3 scripts/dashboard-preview.py "$work/data" "$work/html"
for d in overview realtime autoscaling; do
  size="$(cat "$work/html/$d.size")"
  chromium --headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$work/chromium-$d" \
    --hide-scrollbars --window-size="$size" --screenshot="$root/docs/dashboards-$d.png" \
    "file://$work/html/$d.html" 2>/dev/null
  echo "docs/dashboards-$d.png ($size)"
done
