#!/usr/bin/env bash
# Type-checks and lints ferrite-runtime and ferrite-server, with their tests, for ARM64
# (aarch64-unknown-linux-gnu), so that code behind cfg(target_arch) cannot rot on the x86-64
# machines CI runs on. Clippy links nothing; the target's standard library comes from rustup, and Debian's cross C
# compiler builds the C parts of dependencies' build scripts (ring). Warnings fail it, as in the
# x86-64 build (scripts/clippy-env.sh). docs/ci.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
target=aarch64-unknown-linux-gnu
if ! rustup target list --installed | grep -qx "$target" && ! rustup target add "$target"; then
  # The standard library comes from static.rust-lang.org, not a package registry: a machine
  # that cannot reach it says so in one line rather than failing every run.
  echo "=== AARCH64 CHECK SKIPPED: rustup could not install $target's standard library; it checked nothing"
  exit 0
fi
if ! command -v aarch64-linux-gnu-gcc >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross
fi
# shellcheck source=scripts/clippy-env.sh
source "$root/scripts/clippy-env.sh"
# Clippy with the tests: the NEON kernels' proptests are code behind cfg(target_arch) too.
cargo clippy --target "$target" -p ferrite-runtime -p ferrite-server --lib --bins --tests -- -D warnings
