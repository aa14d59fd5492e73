# Shared by the bench scripts: cd to the repository root, find the model, build the release
# binaries, and start ferrite-servers that are killed when the script exits.
#   source "$(dirname "$0")/common.sh"; serve PORT LOG [server flags...]
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
model="${FERRITE_MODEL:-$(scripts/fetch-model.sh)}"
cargo build --release -q -p ferrite-server -p ferrite-bench
# Where cargo put them (CI shares one target directory across clones).
target=${CARGO_TARGET_DIR:-$root/target}
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

wait_health() { # port
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "server on port $1 did not become healthy" >&2
  exit 1
}

serve() { # port, log file, extra flags...; does not wait for health (SERVER_BIN: another build)
  local port=$1 log=$2
  shift 2
  "${SERVER_BIN:-$target/release/ferrite-server}" --model "$model" --host 127.0.0.1 --port "$port" \
    --served-model-name default ${FERRITE_ARGS:-} "$@" >"$log" 2>&1 &
  pids+=($!)
}

# llama.cpp's llama-server (the baseline of the comparisons): LLAMA_SERVER, else
# scripts/build-llama-server.sh's output. have_llama says whether it is there.
llama="${LLAMA_SERVER:-${LLAMA_CPP_DIR:-$HOME/.cache/ferrite/llama.cpp}/bin/llama-server}"
threads="${THREADS:-$(nproc)}"
have_llama() { [ -x "$llama" ]; }

start_llama() { # port, log file, slots, context (split across the slots); sets llama_pid.
  # LLAMA_ARGS: more flags (e.g. "--cache-ram 0": no host-memory prompt cache).
  "$llama" -m "$model" --host 127.0.0.1 --port "$1" --parallel "$3" --cont-batching -c "$4" \
    -t "$threads" --log-disable ${LLAMA_ARGS:-} >"$2" 2>&1 &
  llama_pid=$!
  pids+=("$llama_pid")
  wait_health "$1"
}

stop_llama() { # stops the llama-server start_llama started last
  kill "$llama_pid" 2>/dev/null || true
  wait "$llama_pid" 2>/dev/null || true
}

kv_tokens() { # port of a healthy ferrite-server: prints how many tokens its KV cache holds
  curl -sf "http://127.0.0.1:$1/metrics" | awk '/^vllm:cache_config_info/ {
    match($0, /block_size="[0-9]+"/); b = substr($0, RSTART + 12, RLENGTH - 13)
    match($0, /num_gpu_blocks="[0-9]+"/); n = substr($0, RSTART + 16, RLENGTH - 17)
    print b * n; exit }'
}

stop_servers() { # stops every server started so far and waits for them to exit
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
