#!/usr/bin/env bash
# Runs the runtime's unit tests (the CPU kernels, the sampler, the stop matcher; on ARM64 every
# kernel takes its portable path) on an emulated ARM64 CPU (QEMU user mode), cross-compiled for
# aarch64-unknown-linux-gnu with Debian's cross gcc as the linker, in the shared target folder
# under its own target name. Installs the rustup target, the cross toolchain and qemu-user if
# missing. Extra arguments are test-name filters. docs/ci.md.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
target=aarch64-unknown-linux-gnu
if ! rustup target list --installed | grep -qx "$target"; then
  rustup target add "$target"
fi
if ! command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || ! command -v qemu-aarch64 >/dev/null 2>&1; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
fi
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
exe=$(cargo test --target "$target" -p ferrite-runtime --lib --no-run --message-format json |
  python3 "$root/scripts/test-executable.py")
[ -n "$exe" ] || { echo "no aarch64 test binary for ferrite-runtime's library" >&2; exit 1; }
echo "== $exe on qemu-aarch64"
qemu-aarch64 -L /usr/aarch64-linux-gnu "$exe" --test-threads "$(nproc)" --nocapture "$@"
