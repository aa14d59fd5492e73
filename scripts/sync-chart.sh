#!/usr/bin/env bash
# Copies what the Helm chart ships from its sources: the generated CRDs (crds/) and the
# dashboards and alerts (dashboards/). tests/it/chart.rs fails when a copy drifts.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
chart="$root/charts/ferrite-operator"
mkdir -p "$chart/crds" "$chart/files/dashboards"
cp "$root"/crds/*.yaml "$chart/crds/"
rm -f "$chart"/files/dashboards/*.json
if compgen -G "$root/dashboards/*.json" >/dev/null; then
  cp "$root"/dashboards/*.json "$chart/files/dashboards/"
fi
if [ -f "$root/dashboards/alerts.yaml" ]; then
  cp "$root/dashboards/alerts.yaml" "$chart/files/alerts.yaml"
fi
echo "synced crds/ and dashboards/ into ${chart#"$root"/}"
