#!/usr/bin/env bash
# Compiles the CUDA build without a GPU, as CI proves it: ferrite-server's binary and the test
# binaries of the crates whose code has a `cuda` feature (runtime, server), with the PyPI
# toolchain of scripts/cuda-env.sh, linted by clippy as the CPU build is (scripts/clippy-env.sh).
# It proves the code rather than runs it, so nothing is optimised: profile `cuda-ci`
# (target/cuda-ci) for the Rust code, and the device code without cicc's and ptxas's
# optimisations (NVCC_APPEND_FLAGS; measured on one of candle's mmq_instance files: 75 s at
# their -O3, 33 s unoptimised). Kernels for one architecture: SASS for CUDA_ARCHS (default 80)
# and PTX for CUDA_COMPUTE_CAP (default 80). candle-kernels' build compiles its files on half
# the cores unless CUDAFORGE_THREADS says otherwise: here, all of them. The image
# (server/Dockerfile.cuda) and scripts/gpu-check.sh build optimised kernels for their GPUs.
# scripts/test.sh runs this under CI=true (or FERRITE_CUDA_BUILD=1), in the background at the
# lowest priority; extra arguments go to cargo.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export CUDA_ARCHS="${CUDA_ARCHS:-80}"
export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:--Xcicc -O0 -Xptxas -O0}"
CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"
export CUDAFORGE_THREADS
eval "$("$root/scripts/cuda-env.sh")"
# shellcheck source=scripts/clippy-env.sh
source "$root/scripts/clippy-env.sh"
start=$(date +%s)
cargo build --profile cuda-ci --locked \
  -p ferrite-server -p ferrite-runtime --features ferrite-server/cuda,ferrite-runtime/cuda \
  --bins --tests "$@"
echo "CUDA build took $(( $(date +%s) - start )) s"
# The GPU code in the server binary: SASS for every CUDA_ARCHS entry and PTX of the newest (the
# compiled kernels), PTX text for compute_$CUDA_COMPUTE_CAP (candle's modules and ferrite's
# kernels, paged attention and the fused ones, whose entry points must be there).
newest=$(printf '%s\n' $CUDA_ARCHS | sort -n | tail -1)
python3 "$root/scripts/cuda-archs.py" "${CARGO_TARGET_DIR:-$root/target}/cuda-ci/ferrite-server" \
  --sass "${CUDA_ARCHS// /,}" --ptx "$newest" --text-ptx "$CUDA_COMPUTE_CAP" \
  --entry paged_attention_f32 --entry paged_attention_f16 --entry paged_attention_bf16 \
  --entry paged_attention_combine \
  --entry rope_cache_write_f32 --entry rope_cache_write_f16 --entry rope_cache_write_bf16 \
  --entry swiglu_f32
