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

stop_servers() { # stops every server started so far and waits for them to exit
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
