#!/usr/bin/env bash
# Prepares the GPU check on a machine without a GPU, so that a short loan of a GPU machine
# (minutes, at most 64 MiB carried per call, nothing reachable from it) goes to the GPU:
#   1. builds, with the PyPI CUDA 13.0 toolchain CI uses (scripts/cuda-env.sh), for the GPU's
#      architecture only (CUDA_ARCHS, default 90: H100/H200) and a CPU any GPU host has
#      (x86-64-v3): ferrite-server, the GPU test binaries (runtime/tests/gpu.rs,
#      server/tests/gpu_serving.rs), bench-runtime with `cuda`, and bench-serve;
#   2. builds llama.cpp's llama-server with CUDA from the same toolchain
#      (scripts/build-llama-server.sh --cuda), the serving baseline;
#   3. packs them with the default model into .gpu-check/ (git-ignored): debug info stripped,
#      one xz stream split into parts of at most PART_MIB (default 56) MiB, so that each part
#      and the working tree fit one call's 64 MiB; parts.sha256 lists them;
#   4. prints the device calls to make: one per part, the last one runs scripts/gpu-run.sh.
# With --dry-run it then unpacks the bundle elsewhere and runs scripts/gpu-run.sh --dry-run:
# every library resolves, the GPU tests run (and skip, loudly), ferrite serves on the CPU.
#
#   scripts/gpu-check.sh [--dry-run]
# Env: CARGO_TARGET_DIR for this build (default ~/.cache/ferrite/target-gpu, apart from CI's
# so that switching architectures rebuilds neither), CUDA_ARCHS, PART_MIB, FERRITE_CUDA_DIR.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
t0=$(date +%s)
log() { echo "gpu-check [$(( $(date +%s) - t0 ))s]: $*" >&2; }

export FERRITE_CUDA_DIR="${FERRITE_CUDA_DIR:-$HOME/.cache/ferrite/cuda}"
export CUDA_ARCHS="${CUDA_ARCHS:-90}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-$(printf '%s\n' $CUDA_ARCHS | sort -n | tail -1)}"
export CARGO_TARGET_DIR="${GPU_CHECK_TARGET_DIR:-$HOME/.cache/ferrite/target-gpu}"
part_mib="${PART_MIB:-56}"
pack="$root/.gpu-check"

# 1. ferrite, for the GPU host: its CPU is not this one, so no target-cpu=native.
log "building ferrite for sm_${CUDA_ARCHS// /,sm_} into $CARGO_TARGET_DIR"
eval "$(scripts/cuda-env.sh)"
export RUSTFLAGS="-C target-cpu=x86-64-v3"
s=$(date +%s)
features=ferrite-server/cuda,ferrite-runtime/cuda,ferrite-bench/cuda
targets=(--bin ferrite-server --bin bench-runtime --bin bench-serve --test gpu --test gpu_serving)
cargo build --profile release-cuda --locked -p ferrite-server -p ferrite-runtime -p ferrite-bench \
  --features "$features" "${targets[@]}"
# Where cargo put each executable (test binaries carry a hash in their names).
exes=$(cargo build --profile release-cuda --locked -p ferrite-server -p ferrite-runtime \
  -p ferrite-bench --features "$features" "${targets[@]}" --message-format json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        kind = "tests" if m["profile"]["test"] else "bin"
        print(kind, m["target"]["name"], m["executable"])')
ferrite_s=$(( $(date +%s) - s ))
log "ferrite built (${ferrite_s}s)"

# 2. llama-server with CUDA (about an hour on 2 cores when cold; kept afterwards).
s=$(date +%s)
llama=$(CUDA_ARCHS="$CUDA_ARCHS" scripts/build-llama-server.sh --cuda | tail -1)
log "llama-server: $llama ($(( $(date +%s) - s ))s)"

# 3. The bundle.
model=$(scripts/fetch-model.sh)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
b="$stage/gpu-check"
mkdir -p "$b/bin" "$b/tests" "$b/model"
while read -r kind name path; do
  cp "$path" "$b/$kind/$name"
done <<<"$exes"
cp "$llama" "$b/bin/llama-server"
strip --strip-debug "$b"/bin/* "$b"/tests/*
ln "$model" "$b/model/" 2>/dev/null || cp "$model" "$b/model/"
{
  echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!.gpu-check' || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%FT%TZ) on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
  echo "CUDA: $(nvcc --version | tail -1); SASS sm_${CUDA_ARCHS// /,sm_}; PTX compute_$CUDA_COMPUTE_CAP; host code x86-64-v3"
  echo "llama.cpp: llama-server from the llama-cpp-python $(sed -n 's/^version=//p' scripts/build-llama-server.sh) sdist, CUDA, flash attention and CUDA graphs on"
  echo "sizes (stripped of debug info):"
  (cd "$b" && du -b bin/* tests/* model/* | awk '{printf "  %-50s %6.1f MiB\n", $2, $1 / 1048576}')
} >"$b/BUILD-INFO"
cat "$b/BUILD-INFO" >&2
rm -rf "$pack"
mkdir -p "$pack"
log "compressing"
# One xz stream with a dictionary larger than any binary: the binaries share most of their code
# and candle's kernels (~40 MiB of fatbin each), so each after the first costs little.
# (Multithreaded xz would cut the stream into blocks that cannot see each other.)
tar -C "$stage" -cf - gpu-check/BUILD-INFO gpu-check/bin gpu-check/tests gpu-check/model |
  xz -T1 --lzma2=preset=6,dict=192MiB | split -b "${part_mib}M" -d - "$pack/part-"
(cd "$pack" && sha256sum part-* >parts.sha256)
total=$(cat "$pack"/part-* | wc -c)
raw=$(du -sb "$b" | cut -f1)
log "bundle: $(awk -v r="$raw" 'BEGIN{printf "%.1f", r/1048576}') MiB raw, $(awk -v t="$total" 'BEGIN{printf "%.1f", t/1048576}') MiB compressed, in $(wc -l <"$pack/parts.sha256") parts of at most $part_mib MiB"
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
log "the working tree that travels with each call: $(awk -v t="$tree" 'BEGIN{printf "%.1f", t/1048576}') MiB"

# 4. The calls.
n=$(wc -l <"$pack/parts.sha256")
echo
echo "Device calls, one after another while the machine is warm (each carries one part):"
i=0
for p in $(awk '{print $2}' "$pack/parts.sha256"); do
  i=$((i + 1))
  if [ $i -lt "$n" ]; then
    echo "  run  carry=[\".gpu-check/parts.sha256\", \".gpu-check/$p\"]  command: bash scripts/gpu-run.sh --part"
  else
    echo "  run  carry=[\".gpu-check/parts.sha256\", \".gpu-check/$p\"]  timeout_s=540  command: bash scripts/gpu-run.sh"
  fi
done
echo "Results: \$OUT/summary.txt, run.log, serve.json, logs.tar.xz, ncu.csv"

if [ "$dry" = 1 ]; then
  log "dry run: unpacking and running scripts/gpu-run.sh --dry-run"
  OUT="$pack/dry-out" GPU_CHECK_WORK="$stage/work" scripts/gpu-run.sh --dry-run
fi
