#!/usr/bin/env bash
# The GPU half of scripts/gpu-check.sh: runs on a machine with an NVIDIA GPU (driver R580 or
# newer) from the bundle that gpu-check.sh packed into .gpu-check/ (git-ignored), without
# building anything:
#   1. runtime/tests/gpu.rs and server/tests/gpu_serving.rs with FERRITE_REQUIRE_GPU=1, so
#      nothing passes by skipping;
#   2. bench-runtime --device cuda: decode tok/s at batch 1, 8, 32 with CUDA graphs and op by
#      op, and each step's bytes as a share of the device-to-device copy bandwidth measured in
#      the same run; prefill tok/s of 1, 8 and 32 128-token prompts in one forward; the same
#      decode at 1,024 tokens of context (what attention adds as a sequence grows);
#   3. bench-serve at concurrency 1, 8, 32 against llama.cpp's llama-server built with CUDA
#      (the baseline), ferrite-server --device cuda and the same with --enforce-eager (no CUDA
#      graphs), same GGUF, same KV capacity, two alternating repetitions.
#   4. ncu (Nsight Compute, where the machine has it): every kernel's time in a short batch-1
#      decode, eager and replayed from graphs (ncu.csv).
# Every step has its own time limit and the run goes on past a failed step; the whole run is
# meant to end within 8 minutes. Results go to $OUT (the device tool's output folder), else
# .gpu-check/out: summary.txt (one line per step, then the figures), run.log (everything),
# serve.json (bench-serve's raw samples), logs.tar.xz (the servers' logs) and ncu.csv.
#
# The bundle may arrive in several parts (the device tool carries at most 64 MiB a call):
#   scripts/gpu-run.sh --part    reports which parts are here and exits (the calls before the
#                                last carry one part each; the machine keeps them while warm)
#   scripts/gpu-run.sh           checks every part's sha256, unpacks, runs
#   scripts/gpu-run.sh --dry-run the same on a machine without a GPU (gpu-check.sh --dry-run):
#                                libraries resolved, tests run and skip, ferrite on the CPU
#   GPU_CHECK_ONLY=tests         runs the tests only
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
pack="$root/.gpu-check"
out="${OUT:-$pack/out}"
work="${GPU_CHECK_WORK:-/tmp/ferrite-gpu-check}"
mode=run
case "${1:-}" in
  --part) mode=part ;;
  --dry-run) mode=dry ;;
  "") ;;
  *) echo "usage: $0 [--part|--dry-run]" >&2; exit 2 ;;
esac
mkdir -p "$out"
log="$out/run.log"
summary="$out/summary.txt"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$log"; }
result() { echo "$*" >>"$summary"; say "$*"; }

# Which parts are here, against the list gpu-check.sh wrote (parts.sha256 travels with each).
parts_here() {
  [ -f "$pack/parts.sha256" ] || { echo "no $pack/parts.sha256: carry it with each part" >&2; return 1; }
  local missing=0 name
  while read -r sum name; do
    if [ -f "$pack/$name" ]; then
      echo "part $name: here ($(stat -c %s "$pack/$name") bytes)"
    else
      echo "part $name: MISSING"; missing=1
    fi
  done <"$pack/parts.sha256"
  return $missing
}

if [ "$mode" = part ]; then
  parts_here
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  exit 0
fi

: >"$summary"
: >"$log"
say "ferrite GPU check ($mode) on $(hostname), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
if ! parts_here | tee -a "$log"; then
  result "FAIL bundle: parts missing (the machine went back between calls?); carry them again"
  exit 1
fi
if ! (cd "$pack" && sha256sum --quiet -c parts.sha256) >>"$log" 2>&1; then
  result "FAIL bundle: a part's sha256 does not match parts.sha256"
  exit 1
fi
rm -rf "$work" && mkdir -p "$work"
unpack() {
  if command -v xz >/dev/null; then
    cat "$@" | xz -d -T0 | tar -x -C "$work"
  else
    cat "$@" | python3 -c 'import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1])' "$work"
  fi
}
# shellcheck disable=SC2046
unpack $(awk -v d="$pack" '{print d "/" $2}' "$pack/parts.sha256") || {
  result "FAIL bundle: unpacking"; exit 1; }
b="$work/gpu-check"
say "unpacked $(du -sh "$b" | cut -f1) into $b"
cat "$b/BUILD-INFO" | tee -a "$log"

# The libraries the binaries need beyond the system's: cuBLAS, cuRAND, NVRTC, the CUDA runtime.
# A GPU machine has them with its toolkit or its Python CUDA wheels; the dry run uses the PyPI
# toolchain's (and its libcuda stub, so that the binaries load at all).
libdirs=()
need=$(for f in "$b"/bin/* "$b"/tests/*; do readelf -d "$f" 2>/dev/null; done |
  sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort -u |
  grep -E '^lib(cuda|cublas|cublasLt|curand|nvrtc|cudart)\.so' || true)
search=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64
  /usr/lib/x86_64-linux-gnu)
for site in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null) \
  /opt/*/.venv/lib/python3*/site-packages; do
  for d in "$site"/nvidia/cu13/lib "$site"/nvidia/*/lib; do [ -d "$d" ] && search+=("$d"); done
done
if [ "$mode" = dry ]; then
  eval "$("$root/scripts/cuda-env.sh")"
  mkdir -p "$work/stub"
  ln -sf "$CUDA_ROOT/lib/stubs/libcuda.so" "$work/stub/libcuda.so.1"
  search=("$work/stub" "$CUDA_ROOT/lib" "${search[@]}")
fi
for lib in $need; do
  found=""
  for d in "${search[@]}"; do
    if [ -e "$d/$lib" ]; then found=$d; break; fi
  done
  if [ -z "$found" ]; then
    found=$(find /usr /opt -name "$lib" -print -quit 2>/dev/null | xargs -r dirname)
  fi
  if [ -n "$found" ]; then
    say "$lib: $found"
    case " ${libdirs[*]} " in *" $found "*) ;; *) libdirs+=("$found") ;; esac
  else
    say "$lib: NOT FOUND"
  fi
done
export LD_LIBRARY_PATH="$(IFS=:; echo "${libdirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
unresolved=$(for f in "$b"/bin/* "$b"/tests/*; do ldd "$f" | grep 'not found' | sed "s|^|${f##*/}: |"; done)
if [ -n "$unresolved" ]; then
  result "FAIL libraries: $unresolved"
  exit 1
fi
result "PASS libraries: every binary's libraries resolve"

export FERRITE_MODEL="$b/model/$(ls "$b/model")"
export FERRITE_SERVER_BIN="$b/bin/ferrite-server"
export CUDA_CACHE_PATH="$work/nv-cache"
export RUST_BACKTRACE=1
device=cuda
if [ "$mode" = dry ]; then
  device=cpu
else
  export FERRITE_REQUIRE_GPU=1
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv 2>&1 | tee -a "$log" "$out/gpu.txt" >/dev/null
fi
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
result "device: ${gpu:-no GPU (dry run)}"

step() { # name, limit in seconds, command...; one PASS/FAIL line in the summary
  local name=$1 limit=$2 s rc
  shift 2
  s=$(date +%s)
  say "== $name (limit ${limit}s): $*"
  timeout -k 5 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then
    result "PASS $name ($(( $(date +%s) - s ))s)"
  else
    result "FAIL $name (exit $rc$([ $rc = 124 ] && echo ", timed out"), $(( $(date +%s) - s ))s): see run.log"
  fi
  return $rc
}

# 1. The GPU tests.
step "runtime/tests/gpu.rs" 240 "$b/tests/gpu" --test-threads 1 --nocapture
step "server/tests/gpu_serving.rs" 120 "$b/tests/gpu_serving" --test-threads 1 --nocapture

# GPU_CHECK_ONLY=tests stops here (a rerun after a test fix spends no GPU time on the rest).
if [ "${GPU_CHECK_ONLY:-}" = tests ]; then
  say "done in $(( $(date +%s) - t0 ))s (GPU_CHECK_ONLY=tests)"
  cat "$summary"
  grep -q '^FAIL' "$summary" && exit 1
  exit 0
fi

# 2. Decode against the bandwidth roofline: the weights as the server loads them by default
# (auto: dense on a GPU) and as GGUF blocks (quantized).
runtime_args=(--device "$device")
[ "$mode" = dry ] && runtime_args+=(--steps 4 --batches 1,8 --prefill-len 64 --reps 1 --mix 0,0,0)
for weights in auto quantized; do
  mark=$(wc -l <"$log")
  step "bench-runtime --device $device --weights $weights" 120 "$b/bin/bench-runtime" \
    --model "$FERRITE_MODEL" --weights "$weights" "${runtime_args[@]}"
  tail -n +"$((mark + 1))" "$log" | grep -E '^(ceiling|decode|prefill|model|CUDA graphs)' >>"$summary"
done
# The same decode at a long context: what attention adds as a sequence grows.
long=1024
[ "$mode" = dry ] && long=128
mark=$(wc -l <"$log")
step "bench-runtime --device $device --weights auto --context $long" 120 "$b/bin/bench-runtime" \
  --model "$FERRITE_MODEL" --weights auto --context "$long" "${runtime_args[@]}"
tail -n +"$((mark + 1))" "$log" | grep -E '^decode' | sed "s/^/context $long: /" >>"$summary"

# 3. Serving against llama.cpp on the same GPU. Either server failing to start leaves the
# other measured alone.
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
healthy() { # port, pid, seconds
  local i
  for i in $(seq 1 $(( $3 * 5 ))); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.2
  done
  return 1
}
targets=()
"$b/bin/ferrite-server" --model "$FERRITE_MODEL" --device "$device" --host 127.0.0.1 \
  --port 18181 --served-model-name default >"$work/ferrite-server.log" 2>&1 &
fpid=$!
pids+=($fpid)
kv=0
if healthy 18181 $fpid 120; then
  kv=$(curl -sf http://127.0.0.1:18181/metrics | awk '/^vllm:cache_config_info/ {
    match($0, /block_size="[0-9]+"/); b = substr($0, RSTART + 12, RLENGTH - 13)
    match($0, /num_gpu_blocks="[0-9]+"/); n = substr($0, RSTART + 16, RLENGTH - 17)
    print b * n; exit }')
  say "ferrite-server: KV cache holds $kv tokens"
else
  result "FAIL ferrite-server --device $device did not become healthy: see logs.tar.xz"
fi
# The same KV capacity for llama-server, split across its 32 slots (each must fit a request).
ctx=$(( ${kv:-0} > 32 * 512 ? kv : 32 * 512 ))
if [ "$mode" = run ]; then
  "$b/bin/llama-server" -m "$FERRITE_MODEL" --host 127.0.0.1 --port 18180 --parallel 32 \
    --cont-batching -c "$ctx" -ngl 999 >"$work/llama-server.log" 2>&1 &
  lpid=$!
  pids+=($lpid)
  if healthy 18180 $lpid 60; then
    say "llama-server: --parallel 32 -c $ctx -ngl 999"
    targets+=(--target "llama.cpp=http://127.0.0.1:18180" --pid "llama.cpp=$lpid")
  else
    result "FAIL llama-server did not become healthy: see logs.tar.xz"
  fi
fi
kill -0 $fpid 2>/dev/null && [ "$kv" != 0 ] &&
  targets+=(--target "ferrite=http://127.0.0.1:18181" --pid "ferrite=$fpid")
# The same server without CUDA graphs (vLLM's --enforce-eager): what the graphs buy.
if [ "$mode" = run ] && [ "$kv" != 0 ]; then
  "$b/bin/ferrite-server" --model "$FERRITE_MODEL" --device "$device" --host 127.0.0.1 \
    --port 18182 --served-model-name default --enforce-eager >"$work/ferrite-eager.log" 2>&1 &
  epid=$!
  pids+=($epid)
  if healthy 18182 $epid 120; then
    targets+=(--target "ferrite-eager=http://127.0.0.1:18182" --pid "ferrite-eager=$epid")
  else
    result "FAIL ferrite-server --enforce-eager did not become healthy: see logs.tar.xz"
  fi
fi
serve_args=(--concurrency 1,8,32 --repeat 2)
[ "$mode" = dry ] && serve_args=(--concurrency 1,2 --max-tokens 8 --prompt-tokens 32)
if [ ${#targets[@]} -gt 0 ]; then
  step "bench-serve" 240 "$b/bin/bench-serve" "${targets[@]}" --model default --timeout 60 \
    "${serve_args[@]}" --save "$out/serve.json"
  # The figures: everything bench-serve printed after its header.
  sed -n '/== bench-serve/,$p' "$log" | grep -vE '^\[|^==' | tail -80 >>"$summary"
fi
cleanup
trap - EXIT

# 4. Where a decode step's time goes: Nsight Compute (on the GPU image; it reads the hardware
# counters on Firecracker machines) times every kernel of a short bench-runtime run at batch 1,
# eager and replayed, one CSV row per kernel in launch order (ncu.csv).
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
if [ "$mode" = run ] && [ -n "$ncu" ]; then
  step "ncu: kernel times of a batch-1 decode" 150 "$ncu" --clock-control none \
    --metrics gpu__time_duration.sum --launch-count 2500 \
    --log-file "$work/ncu.log" --export "$work/ncu" \
    "$b/bin/bench-runtime" --model "$FERRITE_MODEL" --device cuda --weights auto \
    --batches 1 --steps 3 --reps 1 --context 256
  "$ncu" --import "$work/ncu.ncu-rep" --csv --page raw --metrics gpu__time_duration.sum \
    >"$out/ncu.csv" 2>>"$log" || true
  say "ncu.csv: $(wc -l <"$out/ncu.csv" 2>/dev/null || echo 0) rows"
elif [ "$mode" = run ]; then
  result "SKIP ncu: not on this machine"
fi
tar -cJf "$out/logs.tar.xz" -C "$work" $(cd "$work" && ls ./*.log 2>/dev/null) 2>/dev/null
say "done in $(( $(date +%s) - t0 ))s"
echo "---- summary"
cat "$summary"
grep -q '^FAIL' "$summary" && exit 1
exit 0
