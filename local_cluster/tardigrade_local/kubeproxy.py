"""kube-proxy for a real node: Services' ClusterIPs, programmed in the node's own namespace.

`RealNode` runs it (`command`) when the node is on a cluster network (`nodenet.py`), in the
node's network namespace like the kubelet, so its rules exist only there: pods of that node
reach any Service's ClusterIP, DNAT'ed to an endpoint on whichever node (the cluster network
routes pod ranges). It talks to kube-apiserver through the node's API proxy (127.0.0.1:6443
in the namespace) as `system:kube-proxy`, the user kube-apiserver's bootstrap ClusterRoleBinding
`system:node-proxier` names (`plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go`),
as kubeadm's kube-proxy and GKE's have it.

Mode: `MODE` (REAL_NODES.md says why). The configuration leaves what is the host's alone:
`conntrack.maxPerCore: 0` ("0 to leave the limit as-is", `k8s.io/kube-proxy/config/v1alpha1`;
`nf_conntrack_max` is host-wide) and the TCP conntrack timeouts at 0 ("must be greater than 0
to set").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tardigrade_local import gobuild
from tardigrade_local.identities import KUBE_PROXY
from tardigrade_local.kubeconfig import write_kubeconfig
from tardigrade_local.pki import Authority

MODE = "nftables"


def config(node_name: str, kubeconfig: Path, cluster_cidr: str, mode: str | None = None
           ) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "mode": mode or MODE,
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": node_name,
        # Inside the node's namespace: no other node's kube-proxy shares these ports.
        "bindAddress": "0.0.0.0", "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        # Traffic from a pod range is the cluster's own (not masqueraded); the Node objects
        # carry no spec.podCIDR (no --allocate-node-cidrs), so not NodeCIDR.
        "detectLocalMode": "ClusterCIDR", "clusterCIDR": cluster_cidr,
        # NodePorts on the node's own address only, as kube-proxy advises when this is
        # unset ("Consider using `--nodeport-addresses primary`", cmd/kube-proxy/app).
        "nodePortAddresses": ["primary"],
        "conntrack": {"maxPerCore": 0, "tcpEstablishedTimeout": "0s",
                      "tcpCloseWaitTimeout": "0s"},
        # Our machines lack CAP_SYS_RESOURCE (REAL_NODES.md): it may not lower its own score.
        "oomScoreAdj": 0,
    }


def command(directory: Path, node_name: str, api_url: str, pki_dir: Path,
            cluster_cidr: str) -> list[str]:
    """Write kube-proxy's certificate, kubeconfig and configuration under `directory`;
    returns its command line."""
    authority = Authority.load(pki_dir)
    client = authority.issue(KUBE_PROXY.common_name, KUBE_PROXY.organizations)
    kubeconfig = write_kubeconfig(directory / "kube-proxy.kubeconfig", api_url,
                                  user=KUBE_PROXY.common_name, ca_pem=authority.cert_pem,
                                  client_cert_pem=client.cert_pem,
                                  client_key_pem=client.key_pem)
    path = directory / "kube-proxy.json"
    path.write_text(json.dumps(config(node_name, kubeconfig, cluster_cidr), indent=2))
    return [str(gobuild.binary("kube-proxy")), f"--config={path}", "--v=2"]
