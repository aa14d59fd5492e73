#!/usr/bin/env bash
# Runs the runtime's unit tests (the CPU kernels with their NEON paths, each against the portable
# one, the sampler, the stop matcher) and then one whole model, the greedy-agreement test against
# llama-server's recorded answers, on an emulated ARM64 CPU (QEMU user mode; its default `max`
# CPU has the dot-product extension, and the NEON-only int8 path is tested beside it). Both are
# cross-compiled for aarch64-unknown-linux-gnu with Debian's cross gcc as the linker, in the
# shared target folder under its own target name. Installs the rustup target, the cross
# toolchain and qemu-user if missing. Extra arguments are test-name filters for the unit tests.
# QEMU_CPU picks another emulated CPU (e.g. cortex-a53: NEON without dotprod). docs/ci.md.
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
echo "== $exe on qemu-aarch64 (${QEMU_CPU:-max})"
qemu-aarch64 -L /usr/aarch64-linux-gnu "$exe" --test-threads "$(nproc)" --nocapture "$@"

model=$("$root/scripts/fetch-model.sh")
it=$(cargo test --target "$target" -p ferrite-runtime --test it --no-run --message-format json |
  python3 "$root/scripts/test-executable.py")
[ -n "$it" ] || { echo "no aarch64 test binary for ferrite-runtime's model tests" >&2; exit 1; }
echo "== greedy agreement with llama-server, $it on qemu-aarch64 (${QEMU_CPU:-max})"
FERRITE_MODEL="$model" qemu-aarch64 -L /usr/aarch64-linux-gnu "$it" --exact --nocapture \
  llama_server_agreement::greedy_answers_agree_with_llama_server
