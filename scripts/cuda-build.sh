#!/usr/bin/env bash
# Compiles the CUDA build without a GPU: ferrite-server's binary, and the test binaries of the
# crates whose code has a `cuda` feature (runtime, server), with the PyPI toolchain of
# scripts/cuda-env.sh. (ferrite-bench's `cuda` feature only forwards it; its code is the same in
# both builds and CI compiles it; scripts/gpu-check.sh builds it for the GPU machine.) Kernels: SASS for sm_80 and sm_90 plus PTX (CUDA_ARCHS,
# CUDA_COMPUTE_CAP; docs/runtime.md). Output: target/release-cuda/ (the `release-cuda` profile
# is `release` in its own folder, so the CPU build in target/release stays as it was).
# scripts/test.sh runs this under CI=true (or FERRITE_CUDA_BUILD=1), in the background at the
# lowest priority; extra arguments go to cargo.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
eval "$("$root/scripts/cuda-env.sh")"
start=$(date +%s)
cargo build --profile release-cuda --locked \
  -p ferrite-server -p ferrite-runtime --features ferrite-server/cuda,ferrite-runtime/cuda \
  --bins --tests "$@"
echo "CUDA build took $(( $(date +%s) - start )) s"
# The GPU code in the server binary: SASS for every CUDA_ARCHS entry and PTX of the newest (the
# compiled kernels), PTX text for compute_$CUDA_COMPUTE_CAP (candle's modules and ferrite's
# paged attention, whose three entry points must be there).
newest=$(printf '%s\n' $CUDA_ARCHS | sort -n | tail -1)
python3 "$root/scripts/cuda-archs.py" "${CARGO_TARGET_DIR:-$root/target}/release-cuda/ferrite-server" \
  --sass "${CUDA_ARCHS// /,}" --ptx "$newest" --text-ptx "$CUDA_COMPUTE_CAP" \
  --entry paged_attention_f32 --entry paged_attention_f16 --entry paged_attention_bf16
