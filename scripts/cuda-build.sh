#!/usr/bin/env bash
# Compiles the CUDA build without a GPU: ferrite-server's binary, and the binaries and test
# binaries of every crate with a `cuda` feature (runtime, server, bench), with the PyPI
# toolchain of scripts/cuda-env.sh. Kernels: SASS for sm_80 and sm_90 plus PTX (CUDA_ARCHS,
# CUDA_COMPUTE_CAP; docs/runtime.md). Output: target/release-cuda/ (the `release-cuda` profile
# is `release` in its own folder, so the CPU build in target/release stays as it was).
# scripts/test.sh runs this under CI=true (or FERRITE_CUDA_BUILD=1); extra arguments go to cargo.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
eval "$("$root/scripts/cuda-env.sh")"
start=$(date +%s)
cargo build --profile release-cuda --locked \
  -p ferrite-server -p ferrite-runtime -p ferrite-bench \
  --features ferrite-server/cuda,ferrite-runtime/cuda,ferrite-bench/cuda \
  --bins --tests "$@"
echo "CUDA build (sm_${CUDA_ARCHS// /, sm_}; PTX compute_${CUDA_COMPUTE_CAP}) took $(( $(date +%s) - start )) s"
