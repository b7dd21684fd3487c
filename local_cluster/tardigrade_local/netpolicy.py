"""The NetworkPolicy enforcer of real nodes: kube-network-policies v0.8.0, run per node.

Upstream deploys it as a DaemonSet (its `install.yaml`): `hostNetwork: true`, privileged
with NET_ADMIN, `/bin/netpol --hostname-override=$(MY_NODE_NAME) --v=2 --nfqueue-id=98`, as
the ServiceAccount `kube-system/kube-network-policies`, whose ClusterRole lists and watches
pods, namespaces and networkpolicies. It writes a table of its own (`table inet
kube-network-policies`, hooked at postrouting, after kube-proxy's DNAT) that sends the first
packet of each connection to or from a pod some policy selects to an nfqueue, and answers
accept or drop from userspace after evaluating the policies (`pkg/networkpolicy`).

Here it runs as that DaemonSet's pod would on a node: in the node's network namespace (what
`hostNetwork` means for a real node), with the same flags, as the same ServiceAccount.
Its `cmd/main.go` knows only `rest.InClusterConfig()`: the API server from
`KUBERNETES_SERVICE_HOST`/`_PORT` (the node's API proxy, 127.0.0.1:6443 in its namespace) and
a token and CA at `/var/run/secrets/kubernetes.io/serviceaccount/`, a path compiled in. A
container gets them mounted there; so does this process, in a mount namespace of its own
(`unshare --mount`, private propagation) with a tmpfs over `/run`, so nothing appears on the
host's `/run`. The token comes from the TokenRequest API (`TOKEN_SECONDS`), as the kubelet
asks for a pod's projected token, but bound to no pod (the process is not one).

Nothing of it outlives the node: its table is in the node's namespace, its mounts in a mount
namespace that ends with the process, its queue (nfnetlink_queue, per network namespace).
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tardigrade_local import gobuild

NAMESPACE = "kube-system"
NAME = "kube-network-policies"
# upstream's install.yaml's queue number; queues are per network namespace, so every node
# may use the same one.
QUEUE_ID = 98
# What rest.InClusterConfig() reads (k8s.io/client-go/rest/config.go).
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# A day: longer than any test's cluster; client-go re-reads the file, never asks for more.
TOKEN_SECONDS = 86400
NFT_TABLE = "kube-network-policies"
RBAC = "rbac.authorization.k8s.io/v1"

# Upstream's install.yaml (v0.8.0), unchanged: no `nodes` (only its AdminNetworkPolicy mode,
# off here, watches them) and no `events` (its event recorder's writes are refused and
# logged, as on a cluster installed from that file).
OBJECTS: tuple[tuple[str, dict[str, Any]], ...] = (
    (f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts", {
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": NAME, "namespace": NAMESPACE}}),
    (f"/apis/{RBAC}/clusterroles", {
        "apiVersion": RBAC, "kind": "ClusterRole", "metadata": {"name": NAME},
        "rules": [{"apiGroups": [""], "resources": ["pods", "namespaces"],
                   "verbs": ["list", "watch"]},
                  {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
                   "verbs": ["list", "watch"]}]}),
    (f"/apis/{RBAC}/clusterrolebindings", {
        "apiVersion": RBAC, "kind": "ClusterRoleBinding", "metadata": {"name": NAME},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": NAME},
        "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]}),
)

# Runs under `unshare --mount`: the token where InClusterConfig looks, then the enforcer in
# its place (exec: the process a node stops is the enforcer itself). $1 the directory with
# `token` and `ca.crt`, the rest its command line.
_LAUNCH = f"""set -e
mount -t tmpfs -o size=1m,mode=0755 tdg-netpol /run
mkdir -p {SERVICE_ACCOUNT_DIR}
mount --bind "$1" {SERVICE_ACCOUNT_DIR}
shift
exec "$@"
"""


class EnforcerError(RuntimeError):
    pass


def _admin_context(pki_dir: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki_dir / "ca.crt"))
    context.load_cert_chain(str(pki_dir / "admin.crt"), str(pki_dir / "admin.key"))
    return context


def _post(api_url: str, path: str, body: dict[str, Any], context: ssl.SSLContext,
          accept_conflict: bool = True) -> dict[str, Any]:
    request = urllib.request.Request(f"{api_url}{path}", data=json.dumps(body).encode(),
                                     method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as err:
        if err.code == 409 and accept_conflict:
            return {}
        raise EnforcerError(f"POST {path}: {err.code} {err.read().decode(errors='replace')}"
                            ) from err


def install(api_url: str, pki_dir: Path) -> str:
    """What `kubectl apply -f install.yaml` would create but the DaemonSet (as the cluster's
    admin; present objects stay), and a token of the ServiceAccount."""
    context = _admin_context(pki_dir)
    for path, body in OBJECTS:
        _post(api_url, path, body, context)
    answer = _post(api_url, f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{NAME}/token",
                   {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                    "spec": {"expirationSeconds": TOKEN_SECONDS}}, context,
                   accept_conflict=False)
    return str(answer["status"]["token"])


def command(directory: Path, node_name: str, api_url: str, pki_dir: Path) -> list[str]:
    """Write the ServiceAccount's token and the CA under `directory`; returns the enforcer's
    command line (to run in the node's network namespace) and the environment it needs."""
    token = install(api_url, pki_dir)
    account = directory / "serviceaccount"
    account.mkdir(parents=True, exist_ok=True)
    (account / "token").write_text(token)
    (account / "token").chmod(0o600)
    (account / "ca.crt").write_bytes((pki_dir / "ca.crt").read_bytes())
    (account / "namespace").write_text(NAMESPACE)
    return ["unshare", "--mount", "--propagation", "private", "--",
            "sh", "-c", _LAUNCH, "netpol-launch", str(account),
            str(gobuild.binary(NAME)), f"--hostname-override={node_name}", "--v=2",
            f"--nfqueue-id={QUEUE_ID}",
            # Its metrics on the node's loopback, not on every address of the node (":9080").
            "--metrics-bind-address=127.0.0.1:9080"]


def environment(api_port_in_node: int) -> dict[str, str]:
    """What the kubelet gives every pod and InClusterConfig reads: the API server, here the
    node's own proxy to it (a hostNetwork pod on GKE reaches the Service's address instead;
    the certificate names 127.0.0.1 too)."""
    return {"KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(api_port_in_node)}
