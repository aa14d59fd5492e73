#!/usr/bin/env bash
# Installs the npm packages the tests validate manifests with into .node/ (git-ignored):
# @kubernetes-models/prometheus-operator and cert-manager for the chart's custom resources; @grafana/schema (Grafana's dashboard
# types), ts-json-schema-generator (turns them into JSON Schema) and ajv for dashboards.
# Prints the node_modules path.
# Idempotent.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="$root/.node"
packages=('@kubernetes-models/prometheus-operator@6.0.0' '@grafana/schema@13.2.3'
  'ts-json-schema-generator@2.10.0' 'ajv@8.20.0' '@kubernetes-models/cert-manager@6.0.0')
if ! command -v npm >/dev/null 2>&1; then
  apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends nodejs npm >&2
fi
stamp="$dir/.installed"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${packages[*]}" ]; then
  mkdir -p "$dir"
  [ -f "$dir/package.json" ] || echo '{"private": true}' > "$dir/package.json"
  npm install --prefix "$dir" --no-audit --no-fund --loglevel=error "${packages[@]}" >&2
  echo "${packages[*]}" > "$stamp"
fi
echo "$dir/node_modules"
