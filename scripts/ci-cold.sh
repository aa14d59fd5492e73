#!/usr/bin/env bash
# Runs `.ci/run` as a new machine would: on a fresh clone of HEAD beside this checkout (so that
# ../shared resolves as it does for CI), with an empty HOME (no ~/.cache, no ~/.cargo registry,
# no target folder), the machine's own rustup toolchain and CI=true. Every line of the log gets
# the seconds since the start. docs/ci.md has the figures this gives.
#   scripts/ci-cold.sh [LOG]      (default LOG: /tmp/ferrite-ci-cold.log)
# Run nothing heavy beside it: the phases' times are what it measures.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
log="${1:-/tmp/ferrite-ci-cold.log}"
clone="$(dirname "$root")/ferrite-ci-cold"
home="$(mktemp -d /tmp/ferrite-ci-home.XXXXXX)"
rm -rf "$clone"
git clone -q "$root" "$clone"
echo "clone: $clone ($(git -C "$clone" log --oneline -1)); HOME: $home; log: $log"
export RUSTUP_HOME="${RUSTUP_HOME:-$HOME/.rustup}"
toolchain_bin="$(dirname "$(rustup which cargo)")"
cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin"
export HOME="$home" CARGO_HOME="$home/.cargo" CI=true
# cargo-nextest comes with the machine, beside rustup's proxies.
export PATH="$toolchain_bin:$cargo_bin:$PATH"
cd "$clone"
start=$(date +%s)
set +e
timeout 5400 .ci/run 2>&1 | while IFS= read -r line; do
  printf '%5d %s\n' $(($(date +%s) - start)) "$line"
done >"$log"
rc=${PIPESTATUS[0]}
echo "exit $rc after $(($(date +%s) - start)) s" | tee -a "$log"
exit "$rc"
