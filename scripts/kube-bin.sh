#!/usr/bin/env bash
# Makes sure the real control plane the operator's e2e tests run is at hand: etcd from Debian's
# etcd-server package, and kube-apiserver and kube-controller-manager v1.32.6 unpacked (checked
# against SHA256SUMS) from ../shared/k8s into <target>/ferrite-kube/bin. Prints that directory;
# point FERRITE_KUBE_BIN at it (the tests also unpack ../shared/k8s themselves).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v xz >/dev/null 2>&1 || need+=(xz-utils)
if [ ${#need[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "etcd 3.4+ and xz are needed: install them and put both on PATH" >&2
    exit 1
  fi
  echo "installing Debian's ${need[*]}" >&2
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi
# Debian starts an etcd service on install where systemd runs; the tests start their own.
shared="$root/../shared/k8s"
target="${CARGO_TARGET_DIR:-$root/target}"
bin="$target/ferrite-kube/bin"
mkdir -p "$bin"
for name in kube-apiserver kube-controller-manager; do
  if [ -x "$bin/$name" ] && [ "$bin/$name.sha256" -nt "$shared/$name.xz" ] 2>/dev/null; then
    continue
  fi
  if [ ! -f "$shared/$name.xz" ]; then
    echo "$shared/$name.xz is missing: see testkit/src/kube/bins.rs for other ways to get $name" >&2
    exit 1
  fi
  (cd "$shared" && grep " $name.xz\$" SHA256SUMS | sha256sum --check --quiet -) >&2
  xz -dc "$shared/$name.xz" > "$bin/$name.partial.$$"
  chmod +x "$bin/$name.partial.$$"
  mv "$bin/$name.partial.$$" "$bin/$name"
  sha256sum "$shared/$name.xz" > "$bin/$name.sha256"
done
ln -sf "$(command -v etcd)" "$bin/etcd"
echo "$bin"
