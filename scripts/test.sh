#!/usr/bin/env bash
# Runs every check and test: formatting, clippy, and the whole workspace's tests (which fetch the
# default model through scripts/fetch-model.sh on first use), the aarch64 check, and under
# CI=true the CUDA build.
# Prints how long each phase took at the end (docs/ci.md has the figures).
#
# Clippy runs inside the test build: clippy-driver compiles the workspace's own crates, with
# every lint of [workspace.lints] and -D warnings, exactly as `cargo clippy --all-targets`
# does, while the dependencies are compiled once, for the tests, instead of a second time in
# check mode (that second compilation was ~10 minutes of a cold run).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

start=$(date +%s)
last=$start
phases=()
phase() { # name: the time since the last phase ended
  local now
  now=$(date +%s)
  phases+=("$1=$((now - last))")
  last=$now
}
summary() {
  local p
  echo "== CI phases (seconds):"
  for p in "${phases[@]}"; do printf '   %-28s %6s\n' "${p%%=*}" "${p#*=}"; done
  printf '   %-28s %6s\n' "total" "$(( $(date +%s) - start ))"
}

# The CUDA build (the server binary and the cuda-featured test binaries) in CI, or locally with
# FERRITE_CUDA_BUILD=1. Cold it is mostly nvcc on candle's kernels (docs/ci.md), so it starts
# now, in the background at nice 19: in this session's scheduling group that gives it only the
# CPU the steps below leave idle (downloads, serial compile steps, tests waiting on servers),
# and it barely slows them. Its profile has its own target folder and lock, so the two cargo
# builds do not wait on each other.
cuda_pid=""
cuda_log="${CARGO_TARGET_DIR:-$root/target}/cuda-build.log"
kill_tree() {
  local child
  for child in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
if [ "${CI:-}" = true ] || [ "${FERRITE_CUDA_BUILD:-}" = 1 ]; then
  mkdir -p "$(dirname "$cuda_log")"
  echo "== CUDA build: started in the background at nice 19 (log: $cuda_log)"
  nice -n 19 "$root/scripts/cuda-build.sh" >"$cuda_log" 2>&1 &
  cuda_pid=$!
  trap '[ -n "$cuda_pid" ] && kill_tree "$cuda_pid"' EXIT
fi
export FERRITE_MODEL="${FERRITE_MODEL:-$("$root/scripts/fetch-model.sh")}"
export FERRITE_TEST_PYTHON="${FERRITE_TEST_PYTHON:-$("$root/scripts/python-env.sh")}"
export FERRITE_NODE_MODULES="${FERRITE_NODE_MODULES:-$("$root/scripts/node-env.sh")}"
prom_dir="$("$root/scripts/prometheus.sh")"
export FERRITE_PROMETHEUS="${FERRITE_PROMETHEUS:-$prom_dir/prometheus}"
export FERRITE_PROMTOOL="${FERRITE_PROMTOOL:-$prom_dir/promtool}"
# etcd, kube-apiserver and kube-controller-manager for the operator's e2e tests.
export FERRITE_KUBE_BIN="${FERRITE_KUBE_BIN:-$("$root/scripts/kube-bin.sh")}"
phase "tools (model, venv, npm, apt)"

echo "== cargo fmt --check"
cargo fmt --all -- --check
phase "fmt"

status=0
echo "== clippy and the test build"
# shellcheck source=scripts/clippy-env.sh
source "$root/scripts/clippy-env.sh"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-run "$@" || status=$?
  phase "clippy + test build"
  if [ "$status" = 0 ]; then
    echo "== tests"
    cargo nextest run --workspace --no-fail-fast --final-status-level fail "$@" || status=$?
    phase "tests"
  fi
else
  cargo test --workspace --no-run "$@" || status=$?
  phase "clippy + test build"
  if [ "$status" = 0 ]; then
    echo "== tests"
    cargo test --workspace --no-fail-fast "$@" || status=$?
    phase "tests"
  fi
fi
# The runtime and the server type-checked and linted for ARM64, so that code behind
# cfg(target_arch) cannot rot on x86-64 (scripts/check-aarch64.sh).
echo "== aarch64 check"
"$root/scripts/check-aarch64.sh" || status=$?
phase "aarch64 check"
if [ -n "$cuda_pid" ]; then
  echo "== CUDA build: waiting for it ($(date +%T))"
  if wait "$cuda_pid"; then
    tail -n 4 "$cuda_log"
  else
    status=1
    tail -n 60 "$cuda_log"
    echo "the CUDA build failed (the whole log: $cuda_log)"
  fi
  cuda_pid=""
  phase "waiting for the CUDA build"
  grep -h '^CUDA build took' "$cuda_log" | sed 's/^/   (/; s/$/, in the background from the start)/' || true
fi
summary
exit "$status"
