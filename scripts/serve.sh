#!/usr/bin/env bash
# Fetches the default model if missing, builds the server in release mode, and starts it.
# Extra arguments go to ferrite-server (e.g. --port 8080 --kv-cache-memory 2GiB).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
model=${FERRITE_MODEL:-$("$root/scripts/fetch-model.sh")}
cd "$root"
cargo build --release -p ferrite-server
exec "${CARGO_TARGET_DIR:-$root/target}/release/ferrite-server" --model "$model" --served-model-name "${FERRITE_SERVED_NAME:-SmolLM2-135M-Instruct}" "$@"
