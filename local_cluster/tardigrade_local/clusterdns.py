"""Cluster DNS for real nodes: CoreDNS serving `cluster.local` from the API server.

What GKE runs as kube-dns (or Cloud DNS), made small: one CoreDNS process (built from
`builds/coredns`, v1.15.0) in the cluster network's namespace (`nodenet.py`), listening on
`nodenet.DNS_ADDRESS`, with the `kubernetes` plugin reading Services, EndpointSlices,
namespaces and pods as `local:cluster-dns`, whose ClusterRole is upstream's `system:coredns`
(`identities.py`). It reaches kube-apiserver through a `netnsproxy` (127.0.0.1:6443 inside
the namespace), as the kubelets do.

Pods find it as GKE's do: the Service `kube-system/kube-dns` at a fixed ClusterIP
(`SERVICE_IP`), which the kubelets are given as `clusterDNS` (`realnode.py`), and which
kube-proxy DNATs to CoreDNS's address. CoreDNS is not a pod here, so the Service has no
selector and its EndpointSlice is written by us (a selectorless Service's endpoints are its
owner's to write, Kubernetes docs, "Services without selectors").

The names served are upstream's (the kubernetes plugin's README, and the Kubernetes DNS
specification, `kubernetes/dns` `docs/specification.md`): `<service>.<ns>.svc.cluster.local`
(its ClusterIP, or every ready endpoint for a headless one), and for a headless Service
`<hostname>.<service>.<ns>.svc.cluster.local`, the endpoint whose pod has that
`spec.hostname` and `spec.subdomain: <service>`, which the trainer's coordinator address uses
(`naming.coordinator_host`). Names outside `cluster.local` are refused: nothing beyond the
cluster is reachable from its namespaces.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import kubernetes

from tardigrade_local import gobuild, lifetime, netnsproxy
from tardigrade_local.identities import CLUSTER_DNS
from tardigrade_local.kubeconfig import write_kubeconfig
from tardigrade_local.lifetime import die_with_parent
from tardigrade_local.nodenet import DNS_ADDRESS, ClusterNetwork
from tardigrade_local.pki import Authority

DOMAIN = "cluster.local"
# In kube-apiserver's Service range (controlplane.SERVICE_CIDR, 10.0.0.0/24) and in the low
# band it leaves to Services that ask for an address (KEP-3070: the first 16 of a /24), so no
# Service made before gets it; .10 as in GKE's and kubeadm's clusters.
SERVICE_IP = "10.0.0.10"
NAMESPACE = "kube-system"
SERVICE = "kube-dns"
API_PORT = 6443
READY_PORT = 8181  # CoreDNS's `ready` plugin
START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 10.0


class ClusterDNSError(RuntimeError):
    pass


def corefile(kubeconfig: Path) -> str:
    # `kubeconfig FILE CONTEXT` (kubernetes plugin README); `pods insecure` answers pod-IP
    # names (`a-b-c-d.<ns>.pod.cluster.local`) as kube-dns did; a short `ttl` and `cache`
    # (upstream's Corefile: 30), since a rank replaced under the same name must resolve to
    # its new address soon.
    return f"""\
.:53 {{
    bind {DNS_ADDRESS}
    errors
    ready {DNS_ADDRESS}:{READY_PORT}
    kubernetes {DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} tardigrade-local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
}}
"""


class ClusterDNS:
    """```
    with ClusterNetwork(tmp / "net") as network, ClusterDNS(network, cluster.info, tmp / "dns"):
        ...  # pods of real nodes on `network` resolve cluster.local names
    ```"""

    def __init__(self, network: ClusterNetwork, info: Mapping[str, Any], directory: Path
                 ) -> None:
        self.network = network
        self.directory = directory.absolute()
        self.api_url = str(info["direct_api_url"])
        self.pki_dir = Path(info["ca_file"]).parent
        self.admin_kubeconfig = str(info["kubeconfig"])
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[TextIO] = []

    def __enter__(self) -> ClusterDNS:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self, timeout: float = START_TIMEOUT_SECONDS) -> ClusterDNS:
        deadline = time.monotonic() + timeout
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            self._start(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, deadline: float) -> None:
        authority = Authority.load(self.pki_dir)
        client = authority.issue(CLUSTER_DNS.common_name, CLUSTER_DNS.organizations)
        kubeconfig = write_kubeconfig(self.directory / "coredns.kubeconfig",
                                      f"https://127.0.0.1:{API_PORT}",
                                      user=CLUSTER_DNS.common_name, ca_pem=authority.cert_pem,
                                      client_cert_pem=client.cert_pem,
                                      client_key_pem=client.key_pem)
        config = self.directory / "Corefile"
        config.write_text(corefile(kubeconfig))
        api = urllib.parse.urlsplit(self.api_url)
        self._spawn("netnsproxy", [sys.executable, "-m", "tardigrade_local.netnsproxy",
                                   str(self.network.netns_path), str(API_PORT),
                                   f"{api.hostname}:{api.port}"])
        self._spawn("coredns", ["nsenter", f"--net={self.network.netns_path}", "--",
                                str(gobuild.binary("coredns")), "-conf", str(config)])
        while not self._ready():
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise ClusterDNSError(f"{name} exited ({proc.returncode}):\n"
                                          f"{self._tail(name)}")
            if time.monotonic() > deadline:
                raise ClusterDNSError(f"CoreDNS not ready in time:\n{self._tail('coredns')}")
            time.sleep(0.5)
        self._publish()

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.directory / f"{name}.log", "a")  # noqa: SIM115
        self._logs.append(log)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
        self._procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=env,
                                             cwd=self.directory, preexec_fn=die_with_parent)

    def _tail(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.directory / f"{name}.log").read_text(errors="replace")[-3000:]
        return ""

    def _ready(self) -> bool:
        """CoreDNS's `ready` plugin answers 200 once the kubernetes plugin has synced."""
        try:
            sock = netnsproxy.socket_in(str(self.network.netns_path))
        except OSError:
            return False
        with sock:
            sock.setblocking(True)
            sock.settimeout(2)
            try:
                sock.connect((DNS_ADDRESS, READY_PORT))
                sock.sendall(b"GET /ready HTTP/1.0\r\n\r\n")
                return sock.recv(64).startswith(b"HTTP/1.0 200")
            except OSError:
                return False

    def _publish(self) -> None:
        """The kube-dns Service and its EndpointSlice (CoreDNS's address)."""
        with kubernetes.config.new_client_from_config(self.admin_kubeconfig) as client:
            core = kubernetes.client.CoreV1Api(client)
            ports = [{"name": "dns", "port": 53, "protocol": "UDP"},
                     {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]
            service = core.create_namespaced_service(NAMESPACE, {
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": SERVICE, "labels": {"k8s-app": SERVICE}},
                "spec": {"clusterIP": SERVICE_IP,
                         "ports": [{**p, "targetPort": 53} for p in ports]}})
            kubernetes.client.DiscoveryV1Api(client).create_namespaced_endpoint_slice(
                NAMESPACE, {
                    "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                    "metadata": {
                        "name": f"{SERVICE}-coredns",
                        "labels": {"kubernetes.io/service-name": SERVICE,
                                   "endpointslice.kubernetes.io/managed-by":
                                       "clusterdns.tardigrade.local"},
                        "ownerReferences": [{"apiVersion": "v1", "kind": "Service",
                                             "name": SERVICE,
                                             "uid": service.metadata.uid}]},
                    "addressType": "IPv4",
                    "endpoints": [{"addresses": [DNS_ADDRESS],
                                   "conditions": {"ready": True}}],
                    "ports": ports})

    def _unpublish(self) -> None:
        with (contextlib.suppress(Exception),
              kubernetes.config.new_client_from_config(self.admin_kubeconfig) as client):
            # Its EndpointSlice goes with it (owner reference).
            kubernetes.client.CoreV1Api(client).delete_namespaced_service(SERVICE, NAMESPACE)

    def stop(self) -> None:
        """Remove the Service, stop CoreDNS and the API proxy. Idempotent."""
        self._unpublish()
        for proc in self._procs.values():
            lifetime.stop(proc, STOP_TIMEOUT_SECONDS)
        self._procs.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
