"""Real nodes on a cluster network: pods reach pods of another node by pod IP, Services by
ClusterIP (kube-proxy), and headless Service names through CoreDNS, as on GKE; and the
network leaves nothing on the machine once stopped.

One cluster, network, DNS and two real nodes for the whole module."""

from __future__ import annotations

import ipaddress
import os
import ssl
import subprocess
import sys

import pytest
from kube_helpers import Kube, condition, wait_for
from kubernetes import client as k8s
from tardigrade_local import clusterdns, gobuild, netnsproxy, nodeimage, nodenet
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.clusterapi import ClusterAPI
from tardigrade_local.clusterdns import ClusterDNS
from tardigrade_local.nodenet import ClusterNetwork
from tardigrade_local.realnode import RealNode, sweep_orphans

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                       reason="real nodes need Linux and root (namespaces, mounts, cgroups)"),
]

NODE_1, NODE_2 = "net-node-1", "net-node-2"
POD_TIMEOUT_SECONDS = 180.0
PORT = 8476  # the trainer's coordinator port (contract.DEFAULT_COORDINATOR_PORT)
# A client retries while kube-proxy programs a new Service (its rules follow the
# EndpointSlice within a sync, about a second): 60 tries, 2 s apart at most.
RETRY = "for i in $(seq 60); do {attempt} && exit 0; sleep 2; done; exit 1"
# busybox's nc (its wget, static glibc, crashes in this image).
GET = "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {host} {port} | grep pong"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    sweep_orphans()
    nodenet.sweep_orphans()
    state = tmp_path_factory.mktemp("netcluster") / "state"
    with LocalCluster(state, nodes=[], with_gcs=False, node_egress=True,
                      endpoint_controllers=True) as running:
        yield running


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    with ClusterNetwork(tmp_path_factory.mktemp("net")) as made:
        yield made


@pytest.fixture(scope="module")
def dns(cluster, network, tmp_path_factory):
    with ClusterDNS(network, cluster.info, tmp_path_factory.mktemp("dns")) as running:
        yield running


@pytest.fixture(scope="module")
def api(cluster, network, tmp_path_factory):
    with ClusterAPI(network, cluster.info, tmp_path_factory.mktemp("api")) as running:
        yield running


@pytest.fixture(scope="module")
def nodes(cluster, network, dns, api, tmp_path_factory):
    one = RealNode.for_cluster(cluster.info, NODE_1, tmp_path_factory.mktemp("n1"), index=1,
                               network=network)
    two = RealNode.for_cluster(cluster.info, NODE_2, tmp_path_factory.mktemp("n2"), index=2,
                               network=network)
    with one, two:
        yield one, two


@pytest.fixture(scope="module")
def kube(cluster):
    return Kube(str(cluster.kubeconfig))


def _server(name: str, node: str, **spec) -> dict:
    """busybox httpd on PORT answering `pong from <hostname>`, Ready once it listens."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                     "terminationGracePeriodSeconds": 1, **spec,
                     "containers": [{
                         "name": "main", "image": nodeimage.BUSYBOX_IMAGE,
                         "imagePullPolicy": "Never",
                         "command": ["sh", "-c", f"mkdir /www && echo pong from $(hostname) "
                                     f"> /www/index.html && exec httpd -f -p {PORT} -h /www"],
                         "readinessProbe": {"tcpSocket": {"port": PORT},
                                            "periodSeconds": 1}}]}}


def _client(kube: Kube, name: str, node: str, script: str) -> str:
    """Run `script` in a pod on `node`; its log once it succeeded."""
    kube.create_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "restartPolicy": "Never", "nodeSelector": {"kubernetes.io/hostname": node},
        "containers": [{"name": "main", "image": nodeimage.BUSYBOX_IMAGE,
                        "imagePullPolicy": "Never", "command": ["sh", "-c", script]}]}})
    pod = kube.wait_phase(name, ("Succeeded", "Failed"), timeout=POD_TIMEOUT_SECONDS)
    log = kube.core.read_namespaced_pod_log(name, "default")
    assert pod["status"]["phase"] == "Succeeded", log
    return log


def _ready(kube: Kube, name: str) -> dict:
    def check():
        pod = kube.pod(name)
        ready = pod and condition(pod, "Ready")
        return pod if ready and ready["status"] == "True" else None

    return wait_for(check, POD_TIMEOUT_SECONDS, what=f"pod {name} Ready")


@pytest.fixture(scope="module")
def server(nodes, kube):
    kube.create_pod(_server("server", NODE_2))
    return _ready(kube, "server")


def test_a_pod_reaches_a_pod_on_the_other_node_by_its_pod_ip(nodes, kube, server):
    one, two = nodes
    pod_ip = server["status"]["podIP"]
    assert ipaddress.ip_address(pod_ip) in ipaddress.ip_network(two.addresses.pod_cidr)
    log = _client(kube, "by-ip", NODE_1, GET.format(host=pod_ip, port=PORT))
    assert log.strip() == "pong from server"
    client_ip = ipaddress.ip_address(kube.pod("by-ip")["status"]["podIP"])
    assert client_ip in ipaddress.ip_network(one.addresses.pod_cidr)
    # The route a VPC-native cluster's VPC has: node 2's pod range via node 2's address.
    assert f"{two.addresses.pod_cidr} via {two.addresses.node_ip}" in "\n".join(
        nodes[0].network.routes())


def test_a_cluster_ip_service_leads_to_the_pod_on_the_other_node(nodes, kube, server):
    service = kube.core.create_namespaced_service("default", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": {"app": "server"},
                 "ports": [{"port": 80, "targetPort": PORT}]}})
    cluster_ip = service.spec.cluster_ip
    # The endpoint controllers run (ClusterConfig.endpoint_controllers).
    discovery = k8s.DiscoveryV1Api(kube.api)

    def endpoint():
        slices = discovery.list_namespaced_endpoint_slice(
            "default", label_selector="kubernetes.io/service-name=web").items
        return [a for s in slices for e in (s.endpoints or []) for a in e.addresses]

    assert wait_for(endpoint, 60, what="web's endpoints") == [server["status"]["podIP"]]
    log = _client(kube, "by-service", NODE_1, RETRY.format(
        attempt=GET.format(host=cluster_ip, port=80)))
    assert log.strip().endswith("pong from server")
    # kube-proxy's rules live in node 1's namespace, none on the host.
    rules = subprocess.run(["ip", "netns", "exec", nodes[0].id, "nft", "list", "ruleset"],
                           capture_output=True, text=True, check=True).stdout
    # nftables mode (kubeproxy.MODE): its own table, with the Service's address.
    assert "table ip kube-proxy" in rules and cluster_ip in rules
    assert nodenet.host_firewall_rules() == []


def test_a_headless_service_name_of_a_pod_on_node_2_resolves_from_node_1(nodes, kube):
    # As the operator renders a gang: a headless Service with publishNotReadyAddresses, the
    # rank's pod with `hostname` and `subdomain` (rendering/manifests.py).
    kube.core.create_namespaced_service("default", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "gang"},
        "spec": {"clusterIP": "None", "selector": {"app": "coord"},
                 "publishNotReadyAddresses": True,
                 "ports": [{"name": "coordinator", "port": PORT, "targetPort": PORT}]}})
    kube.create_pod(_server("coord", NODE_2, hostname="rank-0", subdomain="gang"))
    coord = _ready(kube, "coord")
    fqdn = "rank-0.gang.default.svc.cluster.local"
    log = _client(kube, "by-name", NODE_1, RETRY.format(
        attempt=f"nslookup {fqdn} && {GET.format(host=fqdn, port=PORT)} && "
                f"{GET.format(host='rank-0.gang', port=PORT)} && cat /etc/resolv.conf"))
    assert coord["status"]["podIP"] in log
    # The short name (naming.coordinator_host) through the pod's search path, and the FQDN.
    assert log.count("pong from rank-0") == 2
    assert f"nameserver {clusterdns.SERVICE_IP}" in log
    assert "search default.svc.cluster.local svc.cluster.local cluster.local" in log


def test_a_pod_reaches_the_api_server_through_the_kubernetes_service(nodes, kube, cluster):
    # As an in-cluster client finds it (the trainer's TokenReview); busybox speaks no TLS, so
    # plain HTTP, which kube-apiserver's Go TLS server answers with its own 400.
    log = _client(kube, "to-api", NODE_1, RETRY.format(
        attempt="echo $KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT && "
                "printf 'GET /version HTTP/1.0\\r\\n\\r\\n' | nc -w 5 "
                "kubernetes.default.svc.cluster.local 443 | grep 'HTTPS server'"))
    assert "10.0.0.1:443" in log
    assert "Client sent an HTTP request to an HTTPS server" in log
    # And with TLS, from node 1's namespace: the certificate names the Service's address.
    context = ssl.create_default_context(cafile=cluster.info["ca_file"])
    with netnsproxy.socket_in(str(nodes[0].netns_path)) as sock:
        sock.setblocking(True)
        sock.settimeout(10)
        sock.connect(("10.0.0.1", 443))
        with context.wrap_socket(sock, server_hostname="10.0.0.1") as tls:
            tls.sendall(b"GET /version HTTP/1.0\r\nHost: 10.0.0.1\r\n\r\n")
            answer = b"".join(iter(lambda: tls.recv(65536), b""))
    assert f'"gitVersion": "{gobuild.kubernetes_version()}"'.encode() in answer


def test_stopping_the_nodes_and_the_network_leaves_nothing_behind(nodes, dns, api, network):
    for node in nodes:
        running = node.leftovers()
        assert running["processes"] and running["netns"]
    assert sorted(network.links()) == sorted(node.id for node in nodes)
    for node in nodes:
        node.stop()
        assert node.leftovers() == {"processes": [], "mounts": [], "cgroups": [],
                                    "log_links": [], "netns": [], "host_links": []}
    assert network.links() == [] and network.routes() == []
    dns.stop()
    api.stop()
    network.destroy()
    assert network.leftovers() == {"netns": [], "processes": [], "host_links": [],
                                   "host_addresses": [], "host_firewall": []}


# A process that makes a cluster network and is then killed before it can remove it.
NETWORK_OWNER = """
import sys, time
from pathlib import Path
from tardigrade_local.nodenet import ClusterNetwork
ClusterNetwork(Path(sys.argv[1])).create()
print("ready", flush=True)
time.sleep(3600)
"""


def test_the_network_of_a_killed_process_is_swept(tmp_path_factory):
    directory = tmp_path_factory.mktemp("orphan-net")
    owner = subprocess.Popen([sys.executable, "-c", NETWORK_OWNER, str(directory)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == "ready", "the network was not made"
    finally:
        owner.kill()
        owner.wait()
    orphan = ClusterNetwork(directory)
    assert orphan.leftovers()["netns"], "a namespace outlives the process that made it"
    assert orphan.id in nodenet.sweep_orphans()
    assert orphan.leftovers()["netns"] == []
    assert orphan.id not in nodenet.sweep_orphans()
