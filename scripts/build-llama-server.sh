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
# Usage: scripts/build-llama-server.sh    (env: LLAMA_CPP_DIR, default ~/.cache/ferrite/llama.cpp;
#        JOBS, default 2). Idempotent: prints $LLAMA_CPP_DIR/bin/llama-server on the last line of
# stdout, and does nothing else if that binary already runs `--version`.
set -euo pipefail

version=0.3.36
out="${LLAMA_CPP_DIR:-$HOME/.cache/ferrite/llama.cpp}"
bin="$out/bin/llama-server"
jobs="${JOBS:-2}"

if [ -x "$bin" ] && "$bin" --version >/dev/null 2>&1; then
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

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

# Only this package from source: `--no-binary :all:` would also build its build dependencies
# (cmake, ninja) from source just to prepare the metadata.
log "downloading the llama-cpp-python $version sdist"
python3 -m pip download --quiet --disable-pip-version-check --no-deps \
  --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$tmp" >&2
tar -xzf "$tmp/llama_cpp_python-$version.tar.gz" -C "$tmp"
pkg="$tmp/llama_cpp_python-$version"
src="$pkg/vendor/llama.cpp"
[ -f "$src/tools/server/server.cpp" ] || { log "no llama.cpp server sources in the sdist"; exit 1; }

# The sdist has no git metadata; take the upstream commit from the package's changelog.
commit=$(sed -n "/^## \[$version\]/,/^## \[/s/.*ggml-org\/llama.cpp@\([0-9a-f]\{7,40\}\).*/\1/p" \
  "$pkg/CHANGELOG.md" | head -n 1)

noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
log "configuring llama.cpp ${commit:-unknown}"
cmake -S "$src" -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
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
"$bin" --version >&2
echo "$bin"
