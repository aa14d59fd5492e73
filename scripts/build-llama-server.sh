#!/usr/bin/env bash
# Builds llama.cpp's C++ `llama-server`, the peer that bench/serve.sh and the prefix-cache
# benchmark compare Ferrite against (see ../shared/README.md, "The llama.cpp peer").
# Only package registries are reachable, so the source is the llama.cpp vendored in PyPI's
# llama-cpp-python 0.3.36 sdist (upstream ggml-org/llama.cpp@0c1e57098); only the sdist is
# downloaded and cmake is run on vendor/llama.cpp directly (no Python extension is built).
#
# AMX is off (-mno-amx-tile -mno-amx-int8 -mno-amx-bf16, GGML_AMX_*=OFF): the CI CPU reports AMX
# (Sapphire Rapids under KVM) but a native build faulted on `ldtilecfg` in ggml's AMX matmul.
# The rest of the build is native (GGML_NATIVE=ON), static (BUILD_SHARED_LIBS=OFF), without the
# web UI (nothing to download) and without OpenSSL (the benchmarks speak plain HTTP).
#
# With `--cuda` it builds the GPU peer for scripts/gpu-check.sh instead: ggml's CUDA backend
# (flash attention and CUDA graphs on, as upstream's defaults) with the PyPI CUDA 13.0 toolchain
# of scripts/cuda-env.sh, SASS for each CUDA_ARCHS entry (default 90: H100/H200), and the CPU
# part for x86-64-v3 rather than this machine (the GPU host's CPU is another). cuBLAS and the
# CUDA runtime are linked dynamically and found on the GPU machine.
#
# Usage: scripts/build-llama-server.sh [--cuda]   (env: LLAMA_CPP_DIR, default
#        ~/.cache/ferrite/llama.cpp or ~/.cache/ferrite/llama.cpp-cuda; JOBS, default 2).
#        Idempotent: prints $LLAMA_CPP_DIR/bin/llama-server on the last line of stdout, and
#        does nothing else if that binary is already there (and, for the CPU build, runs
#        `--version`; the CUDA one needs a GPU's libraries to start).
set -euo pipefail

version=0.3.36
cuda=0
[ "${1:-}" = "--cuda" ] && cuda=1
if [ "$cuda" = 1 ]; then
  out="${LLAMA_CPP_DIR:-$HOME/.cache/ferrite/llama.cpp-cuda}"
else
  out="${LLAMA_CPP_DIR:-$HOME/.cache/ferrite/llama.cpp}"
fi
bin="$out/bin/llama-server"
jobs="${JOBS:-2}"

if [ -x "$bin" ] && { [ "$cuda" = 1 ] || "$bin" --version >/dev/null 2>&1; }; then
  echo "$bin"; exit 0
fi

log() { echo "build-llama-server: $*" >&2; }

# Build tools, from Debian only if missing.
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v make >/dev/null || missing+=(make)
command -v g++ >/dev/null || missing+=(g++)
command -v gcc >/dev/null || missing+=(gcc)
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]}"
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

# The CUDA build takes long enough (~1 h on 2 cores) that an interrupted one resumes: its
# sources and build folder stay under $out/work until it has finished.
if [ "$cuda" = 1 ]; then
  tmp="$out/work"; mkdir -p "$tmp"
else
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fi

# Only this package from source: `--no-binary :all:` would also build its build dependencies
# (cmake, ninja) from source just to prepare the metadata.
if [ ! -f "$tmp/llama_cpp_python-$version/vendor/llama.cpp/CMakeLists.txt" ]; then
  log "downloading the llama-cpp-python $version sdist"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps \
    --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$tmp" >&2
  tar -xzf "$tmp/llama_cpp_python-$version.tar.gz" -C "$tmp"
fi
pkg="$tmp/llama_cpp_python-$version"
src="$pkg/vendor/llama.cpp"
[ -f "$src/tools/server/server.cpp" ] || { log "no llama.cpp server sources in the sdist"; exit 1; }

# The sdist has no git metadata; take the upstream commit from the package's changelog.
commit=$(sed -n "/^## \[$version\]/,/^## \[/s/.*ggml-org\/llama.cpp@\([0-9a-f]\{7,40\}\).*/\1/p" \
  "$pkg/CHANGELOG.md" | head -n 1)

noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ "$cuda" = 1 ]; then
  archs="${CUDA_ARCHS:-90}"
  eval "$("$(dirname "$0")/cuda-env.sh")"
  target=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    -DGGML_CUDA=ON -DGGML_CUDA_NCCL=OFF
    -DCMAKE_CUDA_COMPILER="$CUDA_ROOT/bin/nvcc" -DCUDAToolkit_ROOT="$CUDA_ROOT"
    -DCMAKE_CUDA_ARCHITECTURES="$(printf '%s-real;' $archs | sed 's/;$//')"
    -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$CUDA_ROOT/lib/stubs")
else
  target=(-DGGML_NATIVE=ON)
fi
log "configuring llama.cpp ${commit:-unknown}"
cmake -S "$src" -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF \
  "${target[@]}" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_COMMIT="${commit:-unknown}" >&2

log "building llama-server with -j $jobs"
start=$(date +%s)
cmake --build "$tmp/build" --target llama-server -j "$jobs" >&2
log "built in $(( $(date +%s) - start ))s"

mkdir -p "$out/bin"
cp "$tmp/build/bin/llama-server" "$bin.part"
mv "$bin.part" "$bin"
[ "$cuda" = 1 ] && rm -rf "$tmp"
[ "$cuda" = 1 ] || "$bin" --version >&2
echo "$bin"
