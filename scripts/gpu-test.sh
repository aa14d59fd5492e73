#!/usr/bin/env bash
# Runs the GPU tests and the GPU decode benchmark on a machine with an NVIDIA GPU (driver R580
# or newer, `nvidia-smi` on PATH): builds with the PyPI CUDA toolchain (scripts/cuda-env.sh),
# then runs, with FERRITE_REQUIRE_GPU=1 so that nothing passes by skipping:
#   - runtime/tests/gpu.rs: logits on CUDA against the CPU for every GGUF weight type, the
#     default model's greedy tokens, the CUDA attention kernel against the generic path, and
#     a request's tokens alone and inside a mixed batch;
#   - runtime/tests/cuda_kernel_on_cpu.rs: the kernel's source on the CPU (runs anywhere);
#   - server/tests/gpu_serving.rs: 32 concurrent streams, then the gauges back at 0;
#   - bench-runtime --device cuda: decode at batch 1, 8, 32 against the GPU's copy bandwidth.
# Set CUDA_COMPUTE_CAP to the GPU's (e.g. 90) to skip the PTX JIT on first load.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export FERRITE_MODEL="${FERRITE_MODEL:-$("$root/scripts/fetch-model.sh")}"
export FERRITE_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
eval "$("$root/scripts/cuda-env.sh")"
features=ferrite-server/cuda,ferrite-runtime/cuda,ferrite-bench/cuda
# The toolchain's runtime libraries (cuBLAS, cuRAND, NVRTC) from the same wheels; the driver's
# libcuda comes from the system.
export LD_LIBRARY_PATH="$CUDA_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cargo test --profile release-cuda -p ferrite-runtime -p ferrite-server --features "$features" \
  --test gpu --test cuda_kernel_on_cpu --test gpu_serving -- --nocapture --test-threads 1
cargo run --profile release-cuda -p ferrite-bench --features "$features" --bin bench-runtime -- \
  --device cuda "$@"
