#!/usr/bin/env bash
# Builds the release ferrite-server of another commit (a baseline for bench/ab.sh) in a
# temporary worktree, sharing this checkout's cargo target directory so that dependencies are
# not rebuilt, and prints the path of a copy of the binary.
#
#   BASE_BIN=$(scripts/build-at.sh REV) bench/ab.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rev=$(git -C "$root" rev-parse --short "${1:?usage: scripts/build-at.sh REV}")
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
tree=$(mktemp -d "/tmp/ferrite-$rev-XXXX")
trap 'git -C "$root" worktree remove --force "$tree" >/dev/null 2>&1 || true' EXIT
git -C "$root" worktree add --detach "$tree" "$rev" >/dev/null 2>&1
(cd "$tree" && cargo build --release -q -p ferrite-server) >&2
out="/tmp/ferrite-server-$rev"
cp "$CARGO_TARGET_DIR/release/ferrite-server" "$out"
echo "$out"
