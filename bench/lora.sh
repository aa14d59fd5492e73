#!/usr/bin/env bash
# LoRA serving (issue 37), on one ferrite-server holding 8 adapters (scripts/lora-adapter.py,
# rank RANK, default 16, every projection; --max-loras 8; prefix caching off so that both arms
# compute every prompt):
#   throughput: bench-serve at CONCURRENCY (default 8,32) with every request on the base model
#               (the baseline) against every request on the next of the 8 adapters in turn,
#               REPEAT times (default 2) alternating which goes first; ratios are adapters ÷ base;
#   hot load:   POST /v1/load_lora_adapter of one more adapter, PEFT then GGUF form, 3 times
#               each (unloaded in between), in ms;
#   memory:     the server's VmRSS before and after loading 8 more adapters, per adapter, and
#               the bytes one adapter's factors take (from the server's log).
# LORA_DTYPE (default float32) is the server's --lora-dtype; ROUNDS (default 2) is bench-serve's --rounds.
#
#   bench/lora.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"
rank=${RANK:-16}
dir=/tmp/ferrite-bench-lora-r$rank
for s in $(seq 1 9); do
  [ -f "$dir/s$s/adapter.gguf" ] ||
    scripts/lora-adapter.py "$dir/s$s" --model "$model" --rank "$rank" --seed "$s" >/dev/null
done
modules=() names=()
for s in $(seq 1 8); do modules+=("a$s=$dir/s$s/peft"); names+=("a$s"); done
port=18190 log=/tmp/bench-lora-server.log
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True serve "$port" "$log" --no-enable-prefix-caching \
  --max-loras 8 --max-lora-rank "$rank" --max-cpu-loras 17 --lora-dtype "${LORA_DTYPE:-float32}" \
  --lora-modules "${modules[@]}"
pid=${pids[-1]}
wait_health "$port"
url=http://127.0.0.1:$port
list=$(IFS=,; echo "${names[*]}")

echo "== throughput (rank $rank, 8 adapters, one per request in turn)"
"$target"/release/bench-serve --target "base=$url" --target "adapters=$url" \
  --target-models "adapters=$list" --model default \
  --concurrency "${CONCURRENCY:-8,32}" --repeat "${REPEAT:-2}" --rounds "${ROUNDS:-2}" \
  --pid "base=$pid" --pid "adapters=$pid"

post() { # path, json body: prints the HTTP status and the milliseconds it took
  curl -s -o /dev/null -w '%{http_code} %{time_total}\n' -H 'Content-Type: application/json' \
    -d "$2" "$url$1" | awk '{ printf "%s %.1f\n", $1, $2 * 1000 }'
}
echo "== hot load (rank $rank)"
for form in peft adapter.gguf; do
  for i in 1 2 3; do
    read -r code ms < <(post /v1/load_lora_adapter "{\"lora_name\": \"hot\", \"lora_path\": \"$dir/s9/$form\"}")
    [ "$code" = 200 ] || { echo "loading $form: HTTP $code" >&2; exit 1; }
    echo "load $form: $ms ms"
    post /v1/unload_lora_adapter '{"lora_name": "hot"}' >/dev/null
  done
done

rss() { awk '/^VmRSS/ { print $2 }' "/proc/$pid/status"; }
echo "== memory (rank $rank)"
before=$(rss)
for s in $(seq 1 8); do
  read -r code _ < <(post /v1/load_lora_adapter "{\"lora_name\": \"m$s\", \"lora_path\": \"$dir/s$s/peft\"}")
  [ "$code" = 200 ] || { echo "loading m$s: HTTP $code" >&2; exit 1; }
done
after=$(rss)
bytes=$(sed -n 's/.*adapter="\{0,1\}a1"\{0,1\}.*bytes=\([0-9]*\).*/\1/p; s/.*adapter=a1 .*bytes=\([0-9]*\).*/\1/p' "$log" | head -1)
awk -v b="$before" -v a="$after" -v f="${bytes:-0}" 'BEGIN {
  printf "VmRSS %.1f MiB -> %.1f MiB with 8 more adapters: %.2f MiB each (factors: %.2f MiB)\n",
    b / 1024, a / 1024, (a - b) / 1024 / 8, f / 1048576 }'
