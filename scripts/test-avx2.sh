#!/usr/bin/env bash
# Runs the runtime's unit tests (the CPU kernels, and their tests against the portable code) on
# an emulated CPU with AVX2 and FMA but no AVX-512 (QEMU user mode, `-cpu Haswell`): what an
# AVX2-only machine runs and skips, from a machine whose CPU has AVX-512. The binary is built for
# Haswell in its own folder (.cargo/config.toml's target-cpu=native would put AVX-512 everywhere).
# Extra arguments are test-name filters. Installs Debian's qemu-user if missing. docs/ci.md.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
if ! command -v qemu-x86_64 >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq --no-install-recommends qemu-user
fi
export RUSTFLAGS="-C target-cpu=haswell"
export CARGO_TARGET_DIR="${FERRITE_HASWELL_TARGET:-$root/target/haswell}"
exe=$(cargo test -p ferrite-runtime --lib --no-run --message-format json |
  python3 "$root/scripts/test-executable.py")
[ -n "$exe" ] || { echo "no test binary for ferrite-runtime's library" >&2; exit 1; }
echo "== $exe on qemu-x86_64 -cpu Haswell"
# The kernels ask CPUID, which QEMU emulates; its notes on host-only CPUID bits are noise.
qemu-x86_64 -cpu Haswell "$exe" --test-threads "$(nproc)" --nocapture "$@" 2>&1 |
  grep -v "TCG doesn't support requested feature"
