#!/usr/bin/env bash
# Installs the CUDA toolchain that the `cuda` build of ferrite-server needs, from PyPI (pinned
# below), into the git-ignored .cuda/<hash>/ folder, and prints the environment candle's and
# cudarc's build scripts read. No GPU is needed to compile:
#
#   eval "$(scripts/cuda-env.sh)"
#   cargo build --release -p ferrite-server --features cuda
#
# Why CUDA 13.0: PyPI's CUDA 12 wheels (nvidia-cuda-nvcc-cu12, every version) ship ptxas but not
# the nvcc driver, cicc or fatbinary; CUDA 13's split wheels carry the whole compiler. Binaries
# built with it need an NVIDIA driver of the R580 branch or newer on the node (docs/runtime.md).
#
# The driver library (libcuda.so) is not redistributed on PyPI: linking uses a stub built here
# from cuda.h with the driver's soname, as the toolkit's own lib64/stubs does; at run time the
# node's driver (mounted by the NVIDIA container toolkit) is loaded instead.
#
# CUDA_COMPUTE_CAP (default 80) picks the architecture candle's PTX kernels target (PTX for
# compute_80 is JIT-compiled by the driver on sm_86, sm_89, sm_90 and newer). The statically
# compiled kernels (quantized matmul, MoE) get SASS for every architecture in CUDA_ARCHS
# (default "80 90") plus PTX of the newest, through the nvcc wrapper below.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

packages=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-nvrtc==13.0.88
  nvidia-cublas==13.0.2.14
  nvidia-curand==10.4.0.35
)
hash=$(printf '%s\n' "${packages[@]}" "layout-3" | sha256sum | cut -c1-12)
dir="${FERRITE_CUDA_DIR:-$root/.cuda}/$hash"
top="$dir/nvidia/cu13"

if [ ! -f "$dir/.complete" ]; then
  rm -rf "$dir"
  mkdir -p "$dir"
  echo "installing the CUDA 13.0 toolchain from PyPI into $dir" >&2
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$dir" \
    "${packages[@]}" >&2
  # The layout nvcc.profile expects: targets/x86_64-linux/{include,lib}, lib64, and unversioned
  # library names for the linker.
  mkdir -p "$top/targets/x86_64-linux" "$top/lib/stubs"
  ln -sfn ../../include "$top/targets/x86_64-linux/include"
  ln -sfn ../../lib "$top/targets/x86_64-linux/lib"
  ln -sfn lib "$top/lib64"
  for so in "$top"/lib/lib*.so.*; do
    base="${so##*/}"
    ln -sfn "$base" "$top/lib/${base%%.so.*}.so"
  done
  # The driver stub: every cu* function cuda.h declares (after its _v2 macros), exported from an
  # empty library whose soname is the driver's.
  cc -E -P -I"$top/include" -x c "$top/include/cuda.h" 2>/dev/null \
    | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d '( \t' | sort -u \
    | awk '{printf "void %s(void) {}\n", $1}' > "$dir/libcuda-stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$top/lib/stubs/libcuda.so" "$dir/libcuda-stub.c"
  # nvcc with SASS for every CUDA_ARCHS entry on fatbin/object builds; PTX builds keep the one
  # -arch they ask for (nvcc refuses --ptx for several architectures).
  cat > "$top/bin/nvcc-multiarch" <<'EOF'
#!/usr/bin/env bash
here="$(cd "$(dirname "$0")" && pwd)"
args=("$@")
ptx=0
for a in "$@"; do
  case "$a" in --ptx|-ptx) ptx=1 ;; esac
done
if [ "$ptx" = 0 ] && [ -n "${CUDA_ARCHS:-}" ]; then
  extra=()
  filtered=()
  for a in "${args[@]}"; do
    case "$a" in -gencode=*|-arch=*|--gpu-architecture=*) ;; *) filtered+=("$a") ;; esac
  done
  newest=0
  for arch in $CUDA_ARCHS; do
    extra+=("-gencode=arch=compute_${arch},code=sm_${arch}")
    [ "$arch" -gt "$newest" ] && newest=$arch
  done
  extra+=("-gencode=arch=compute_${newest},code=compute_${newest}")
  args=("${filtered[@]}" "${extra[@]}")
fi
exec "$here/nvcc" "${args[@]}"
EOF
  chmod +x "$top/bin/nvcc-multiarch"
  "$top/bin/nvcc" --version >&2
  touch "$dir/.complete"
fi

cat <<EOF
export CUDA_ROOT="$top"
export CUDA_PATH="$top"
export CUDA_HOME="$top"
export CUDA_TOOLKIT_ROOT_DIR="$top"
export PATH="$top/bin:$top/nvvm/bin:\$PATH"
export NVCC="$top/bin/nvcc-multiarch"
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-80}"
export CUDA_ARCHS="\${CUDA_ARCHS:-80 90}"
export LIBRARY_PATH="$top/lib:$top/lib/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
export CPATH="$top/include\${CPATH:+:\$CPATH}"
EOF
