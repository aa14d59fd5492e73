#!/usr/bin/env bash
# Runs every check and test: formatting, clippy, and the whole workspace's tests (which fetch the
# default model through scripts/fetch-model.sh on first use), then under CI=true the CUDA build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export FERRITE_MODEL="${FERRITE_MODEL:-$("$root/scripts/fetch-model.sh")}"
export FERRITE_TEST_PYTHON="${FERRITE_TEST_PYTHON:-$("$root/scripts/python-env.sh")}"
export FERRITE_NODE_MODULES="${FERRITE_NODE_MODULES:-$("$root/scripts/node-env.sh")}"
prom_dir="$("$root/scripts/prometheus.sh")"
export FERRITE_PROMETHEUS="${FERRITE_PROMETHEUS:-$prom_dir/prometheus}"
export FERRITE_PROMTOOL="${FERRITE_PROMTOOL:-$prom_dir/promtool}"
# etcd, kube-apiserver and kube-controller-manager for the operator's e2e tests.
export FERRITE_KUBE_BIN="${FERRITE_KUBE_BIN:-$("$root/scripts/kube-bin.sh")}"
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== tests"
status=0
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast --final-status-level fail "$@" || status=$?
else
  cargo test --workspace --no-fail-fast "$@" || status=$?
fi
# The CUDA build (server binary and the cuda-featured test binaries, sm_80 and sm_90) compiles
# in CI, after the tests so their summary prints first; locally with FERRITE_CUDA_BUILD=1.
if [ "${CI:-}" = true ] || [ "${FERRITE_CUDA_BUILD:-}" = 1 ]; then
  echo "== CUDA build"
  "$root/scripts/cuda-build.sh" || status=$?
fi
exit "$status"
