#!/usr/bin/env bash
# Autoscaling simulation: ferrite's Builtin autoscaler against HPA + prometheus-adapter and a
# KEDA-like poller, each replaying the same bursty trace through the same simulated pods (no
# cluster, no model; about a second). Prints time-to-scale-up, SLO attainment and
# replica-seconds, with ratios against HPA + adapter. Flags go to bench-autoscale
# (defaults: --seed 1 --hours 2 --start-delay 30; see --help).
#
#   bench/autoscale.sh [--seed N] [--hours H] [--start-delay S] [--variant NAME=JSON ...]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p ferrite-bench --bin bench-autoscale
exec "${CARGO_TARGET_DIR:-target}"/release/bench-autoscale "$@"
