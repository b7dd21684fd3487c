"""The NetworkPolicy enforcer of real nodes: kube-router's network policy controller.

kube-router v2.1.0 (`--run-firewall=true --run-router=false --run-service-proxy=false`, its
`daemonset/kube-router-firewall-daemonset.yaml`: enforcement beside another CNI and
kube-proxy), the controller k3s embeds for its NetworkPolicies. Upstream runs it as a
privileged `hostNetwork` DaemonSet with a kubeconfig; here, as kube-proxy (`kubeproxy.py`),
it runs in the node's network namespace (what `hostNetwork` is for a real node) with a
kubeconfig of its own through the node's API proxy, as `local:kube-router`, whose ClusterRole
is upstream's `kube-router` (`identities.py`). It writes iptables chains (`KUBE-ROUTER-*`,
`KUBE-POD-FW-*`, `KUBE-NWPLCY-*`, through Debian's `iptables`, the nf_tables backend here)
and ipsets (`KUBE-SRC-*`, `KUBE-DST-*`, Debian's `ipset`), all in the node's namespace: a pod
a policy selects gets a firewall chain of its own for the traffic the node forwards to it.

Why not kube-network-policies (kubernetes-sigs): it runs here, but every sync of its rules
fails (`netlink receive: no such file or directory`): it sends new connections to userspace
with nftables' `queue` expression, and our machines' kernel is built without
CONFIG_NFT_QUEUE (REAL_NODES.md).

Nothing of it outlives the node: its chains and sets live in the node's namespace.
"""

from __future__ import annotations

from pathlib import Path

from tardigrade_local import gobuild
from tardigrade_local.identities import KUBE_ROUTER
from tardigrade_local.kubeconfig import write_kubeconfig
from tardigrade_local.pki import Authority

NAME = "kube-router"
# What kube-router names in a node's iptables and ipset (`pkg/controllers/netpol`).
CHAIN_PREFIXES = ("KUBE-ROUTER-", "KUBE-POD-FW-", "KUBE-NWPLCY-")
SET_PREFIXES = ("KUBE-SRC-", "KUBE-DST-")


def command(directory: Path, node_name: str, api_url: str, pki_dir: Path,
            service_cidr: str) -> list[str]:
    """Write the enforcer's certificate and kubeconfig under `directory`; returns its command
    line (to run in the node's network namespace)."""
    authority = Authority.load(pki_dir)
    client = authority.issue(KUBE_ROUTER.common_name, KUBE_ROUTER.organizations)
    kubeconfig = write_kubeconfig(directory / "kube-router.kubeconfig", api_url,
                                  user=KUBE_ROUTER.common_name, ca_pem=authority.cert_pem,
                                  client_cert_pem=client.cert_pem,
                                  client_key_pem=client.key_pem)
    return [str(gobuild.binary(NAME)), "--run-firewall=true", "--run-router=false",
            "--run-service-proxy=false", f"--kubeconfig={kubeconfig}",
            f"--hostname-override={node_name}",
            # The cluster's Service range (kube-apiserver's), not kube-router's default
            # 10.96.0.0/12.
            f"--service-cluster-ip-range={service_cidr}", "--v=2"]
