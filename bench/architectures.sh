#!/usr/bin/env bash
# Decode and prefill speed per architecture (issue 38), straight through the model
# (bench-runtime; no HTTP): the checkpoints scripts/gguf-variants.py builds from the default
# model's weights — llama (its F16 form, the baseline), qwen3 (q/k norms), qwen3moe (4 experts of
# the full FFN size, 2 per token: twice the FFN work per token), phi3 (fused projections),
# phi4mini (phi3 with three quarters of each head rotated), gemma3 (q/k norms, norms after each
# block, GeGLU, five of six layers attending within 16 tokens), gemma2 (no q/k norms, every
# other layer within 16 tokens, soft-capped attention scores) — all repacked to the same 8-bit
# weights (--weights packed), so only the architecture differs.
# Decode at batch 1 and 32 (64-token contexts, 32 steps) and a 512-token prefill, best of 2;
# REPEAT rounds (default 2), each running every architecture, in reverse order on odd rounds.
# Prints tok/s and each architecture ÷ llama of the same round.
#
#   bench/architectures.sh   (models are written to /tmp/ferrite-bench-arch/<generator hash>,
#                             ~2 GB; the folders of other versions of the generator are removed)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
model="${FERRITE_MODEL:-$(scripts/fetch-model.sh)}"
cargo build --release -q -p ferrite-bench --bin bench-runtime
target=${CARGO_TARGET_DIR:-$root/target}
dir=/tmp/ferrite-bench-arch/$(sha256sum scripts/gguf-variants.py | cut -c1-12)
find /tmp/ferrite-bench-arch -mindepth 1 -maxdepth 1 ! -path "$dir" -exec rm -rf {} + 2>/dev/null || true
mkdir -p "$dir"
archs=(f16 qwen3 qwen3moe phi3 phi4mini gemma3 gemma2)
for a in "${archs[@]}"; do
  [ -f "$dir/$a.gguf" ] || scripts/gguf-variants.py "$a" "$dir/$a.gguf" --model "$model" >/dev/null
done

run() { # arch: prints "b1 b32 prefill" tok/s
  "$target"/release/bench-runtime --model "$dir/$1.gguf" --weights packed --batches 1,32 \
    --mix 0,0,0 --reps 2 --prefill-len 512 |
    awk '/^decode batch/ {printf "%s ", $4} /^prefill/ {printf "%s\n", $4}'
}

for r in $(seq 1 "${REPEAT:-2}"); do
  order=("${archs[@]}")
  if (( r % 2 == 0 )); then order=(); for (( i=${#archs[@]}-1; i>=0; i-- )); do order+=("${archs[i]}"); done; fi
  declare -A got=()
  for a in "${order[@]}"; do got[$a]=$(run "$a"); done
  read -r l1 l32 lp <<<"${got[f16]}"
  echo "== round $r (tok/s: decode batch 1, batch 32, prefill 512; ratio to llama)"
  for a in "${archs[@]}"; do
    read -r b1 b32 p <<<"${got[$a]}"
    printf '%-9s %8.1f %8.1f %8.1f   %5.2fx %5.2fx %5.2fx\n' "$a" "$b1" "$b32" "$p" \
      "$(echo "$b1/$l1" | bc -l)" "$(echo "$b32/$l32" | bc -l)" "$(echo "$p/$lp" | bc -l)"
  done
done
