#!/usr/bin/env bash
# Router benchmark (issue 20): ferrite-router against a random pick of replica (what kube-proxy
# does behind a ClusterIP Service), with three ferrite-servers behind stand-in pods on a real
# kube-apiserver. Scenarios: skewed traffic (TTFT p99, tok/s), six tenants with their own
# system prompts (prefix-cache hit rate, TTFT), the router's added latency, and scale from zero.
#
#   bench/router.sh [--repeat N] [--scenarios skewed,tenants,overhead,cold] [other bench-router flags]
#
# Needs etcd and kube-apiserver (scripts/kube-bin.sh finds or installs them).
set -euo pipefail
source "$(dirname "$0")/common.sh"
cargo build --release -q -p ferrite-router
export FERRITE_KUBE_BIN="${FERRITE_KUBE_BIN:-$(scripts/kube-bin.sh)}"
"$target"/release/bench-router --model "$model" "$@"
