#!/usr/bin/env bash
# Makes sure Debian's `prometheus` package (prometheus and promtool) is installed: the metrics
# tests start a real Prometheus and lint the exposition with promtool. Prints the directory that
# holds both binaries.
set -euo pipefail
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "prometheus and promtool are needed: install Prometheus 2.x and put both on PATH" >&2
    exit 1
  fi
  echo "installing Debian's prometheus package (prometheus, promtool)" >&2
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus >&2
fi
dirname "$(command -v promtool)"
