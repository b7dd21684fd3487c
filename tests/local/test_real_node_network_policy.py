"""NetworkPolicy enforced on real nodes (kube-router's controller, `netpolicy.py`): the policy the
operator renders for a gang keeps a pod of another namespace off the trainer's ports (8476,
8477), while the gang's own pods reach both and the operator's pods reach the progress port.

One cluster, network and two real nodes enforcing policies for the whole module. The trainer
stand-in (busybox httpd on both ports, the gang's labels) runs on node 1; every client on
node 2, so each connection crosses the cluster network and node 1's enforcer decides it."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
from kube_helpers import Kube, condition, wait_for
from kubernetes import client as k8s
from tardigrade_contract import contract
from tardigrade_local import netpolicy, nodeimage, nodenet
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.nodenet import ClusterNetwork
from tardigrade_local.realnode import RealNode, sweep_orphans
from tardigrade_operator.rendering.manifests import JobRef
from tardigrade_operator.rendering.netpolicy import (
    NetworkPeers,
    build_network_policy,
    gang_selector,
    policy_name,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                       reason="real nodes need Linux and root (namespaces, mounts, cgroups)"),
]

NODE_1, NODE_2 = "pol-node-1", "pol-node-2"
TEAM_A, TEAM_B, OPERATOR_NS = "team-a", "team-b", "tardigrade-system"
JOB = "train"
# The chart's selector labels (charts/tardigrade/templates/_helpers.tpl), which it hands the
# operator as TARDIGRADE_OPERATOR_POD_LABELS.
OPERATOR_LABELS = {"app.kubernetes.io/name": "tardigrade",
                   "app.kubernetes.io/instance": "tardigrade"}
COORDINATOR, PROGRESS = contract.DEFAULT_COORDINATOR_PORT, contract.DEFAULT_PROGRESS_PORT
POD_TIMEOUT_SECONDS = 180.0
# One HTTP exchange with busybox nc (its wget crashes in this image): `open PORT` when the
# trainer answered, `closed PORT` when the connection timed out or was refused.
PROBE = ("if printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {host} {port} | grep -q pong; "
         "then echo open {port}; else echo closed {port}; fi")
# Admitted: tries until the trainer answers (a new pod's address reaches the enforcer through
# the API server, about a second after the pod starts); 60 tries.
UNTIL_OPEN = ("(for i in $(seq 60); do printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {host} {port}"
              " | grep -q pong && echo open {port} && exit 0; sleep 1; done; echo closed {port})")
# Refused: several tries, spread over more than that second, and every one must fail.
TRIES = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    sweep_orphans()
    nodenet.sweep_orphans()
    state = tmp_path_factory.mktemp("polcluster") / "state"
    with LocalCluster(state, nodes=[], with_gcs=False, node_egress=True) as running:
        yield running


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    with ClusterNetwork(tmp_path_factory.mktemp("net")) as made:
        yield made


@pytest.fixture(scope="module")
def nodes(cluster, network, tmp_path_factory):
    one = RealNode.for_cluster(cluster.info, NODE_1, tmp_path_factory.mktemp("p1"), index=1,
                               network=network, network_policies=True)
    two = RealNode.for_cluster(cluster.info, NODE_2, tmp_path_factory.mktemp("p2"), index=2,
                               network=network, network_policies=True)
    with one, two:
        yield one, two


@pytest.fixture(scope="module")
def kube(cluster):
    made = Kube(str(cluster.kubeconfig))
    for namespace in (TEAM_A, TEAM_B, OPERATOR_NS):
        made.core.create_namespace({"metadata": {"name": namespace}})
        # The ServiceAccount admission refuses pods until the namespace's `default` exists.
        wait_for(lambda ns=namespace: made.core.list_namespaced_service_account(
            ns, field_selector="metadata.name=default").items, 60,
            what=f"the default ServiceAccount of {namespace}")
    return made


GANG_LABELS = gang_selector(JOB)["matchLabels"]


def _pod(name: str, node: str, labels: dict[str, str], script: str, **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                     "terminationGracePeriodSeconds": 1, **spec,
                     "containers": [{"name": "main", "image": nodeimage.BUSYBOX_IMAGE,
                                     "imagePullPolicy": "Never",
                                     "command": ["sh", "-c", script]}]}}


@pytest.fixture(scope="module")
def trainer(nodes, kube):
    """Stands for rank 0 of the gang: the coordinator and progress ports, the gang's labels."""
    pod = _pod("rank-0", NODE_1, GANG_LABELS,
               "mkdir /www && echo pong > /www/index.html && "
               f"httpd -p {COORDINATOR} -h /www && exec httpd -f -p {PROGRESS} -h /www")
    pod["spec"]["containers"][0]["readinessProbe"] = {
        "tcpSocket": {"port": COORDINATOR}, "periodSeconds": 1}
    kube.create_pod(pod, TEAM_A)

    def ready():
        found = kube.pod("rank-0", TEAM_A)
        state = found and condition(found, "Ready")
        return found if state and state["status"] == "True" else None

    return wait_for(ready, POD_TIMEOUT_SECONDS, what="the trainer stand-in Ready")


def _client(kube: Kube, name: str, namespace: str, labels: dict[str, str], script: str
            ) -> str:
    """Run `script` in a pod on node 2; its log once it ended."""
    kube.create_pod(_pod(name, NODE_2, labels, script, restartPolicy="Never"), namespace)
    pod = kube.wait_phase(name, ("Succeeded", "Failed"), timeout=POD_TIMEOUT_SECONDS,
                          namespace=namespace)
    log = kube.core.read_namespaced_pod_log(name, namespace)
    assert pod["status"]["phase"] == "Succeeded", log
    return log


def _until_open(ip: str, *ports: int) -> str:
    return "; ".join(UNTIL_OPEN.format(host=ip, port=port) for port in ports)


def _tries(ip: str, *ports: int) -> str:
    once = "; ".join(PROBE.format(host=ip, port=port) for port in ports)
    return f"for i in $(seq {TRIES}); do {once}; sleep 1; done"


def _iptables(node: RealNode) -> str:
    return subprocess.run(["ip", "netns", "exec", node.id, "iptables-save"],
                          capture_output=True, text=True, check=True).stdout


def _policed(node: RealNode) -> bool:
    """A local pod's firewall chain (kube-router makes one for every pod) runs the gang's
    policy: the enforcer of `node` has seen the policy and the pods it selects."""
    return f'"run through nw policy {policy_name(JOB)}"' in _iptables(node)


def test_without_a_policy_a_pod_of_another_namespace_reaches_the_trainer(nodes, kube, trainer):
    ip = trainer["status"]["podIP"]
    # The enforcers run, each with its chains in its node's namespace and none on the host.
    for node in nodes:
        wait_for(lambda node=node: ":KUBE-ROUTER-FORWARD" in _iptables(node), 60,
                 what=f"the enforcer's chains in {node.name}'s namespace")
    assert nodenet.host_firewall_rules() == []
    assert not _policed(nodes[0])
    log = _client(kube, "before", TEAM_B, GANG_LABELS, _until_open(ip, COORDINATOR, PROGRESS))
    assert log.split() == ["open", str(COORDINATOR), "open", str(PROGRESS)], log


def test_the_operators_policy_keeps_other_namespaces_off_the_gang(nodes, kube, trainer):
    ip = trainer["status"]["podIP"]
    policy = build_network_policy(
        JobRef(JOB, TEAM_A, "00000000-0000-0000-0000-000000000001"),
        NetworkPeers(operator_namespace=OPERATOR_NS, operator_pod_labels=OPERATOR_LABELS))
    # No TrainingJob exists here: the garbage collector would delete a policy whose owner is
    # missing. Everything else is the renderer's.
    del policy["metadata"]["ownerReferences"]
    k8s.NetworkingV1Api(kube.api).create_namespaced_network_policy(TEAM_A, policy)
    # Node 1's enforcer has seen the policy once the trainer has a firewall chain.
    wait_for(lambda: _policed(nodes[0]), 60, what="the policy in node 1's firewall")

    # Another namespace, even with the gang's labels (the policy's podSelector is the
    # policy's namespace only): refused on both ports, every try.
    log = _client(kube, "intruder", TEAM_B, GANG_LABELS, _tries(ip, COORDINATOR, PROGRESS))
    assert log.split().count("closed") == 2 * TRIES and "open" not in log, log

    # The gang's own pod (another rank) reaches both.
    log = _client(kube, "rank-1", TEAM_A, GANG_LABELS, _until_open(ip, COORDINATOR, PROGRESS))
    assert log.split() == ["open", str(COORDINATOR), "open", str(PROGRESS)], log

    # The operator's pod gets progress, and only that: the coordinator stays closed to it.
    log = _client(kube, "operator", OPERATOR_NS, OPERATOR_LABELS,
                  f"{_until_open(ip, PROGRESS)}; {_tries(ip, COORDINATOR)}")
    words = log.split()
    assert words[:2] == ["open", str(PROGRESS)], log
    assert words[2:].count("closed") == TRIES and "open" not in words[2:], log

    # A pod of the job's namespace without the gang's labels is no peer either.
    log = _client(kube, "neighbour", TEAM_A, {"app": "other"}, _tries(ip, PROGRESS))
    assert log.split().count("closed") == TRIES and "open" not in log, log


def test_stopping_the_nodes_leaves_nothing_behind(nodes, network):
    for node in nodes:
        enforcers = [pid for pid in node.leftovers()["processes"]
                     if netpolicy.NAME in " ".join(_cmdline(int(pid)))]
        assert enforcers, "no enforcer runs in the node's namespace"
    for node in nodes:
        node.stop()
        assert node.leftovers() == {"processes": [], "mounts": [], "cgroups": [],
                                    "log_links": [], "netns": [], "host_links": []}
    network.destroy()
    assert network.leftovers() == {"netns": [], "processes": [], "host_links": [],
                                   "host_addresses": [], "host_firewall": []}
    # host_firewall: no chain or ipset of the enforcer's on the host.


def _cmdline(pid: int) -> list[str]:
    """A process's command line, or none for one that ended since it was listed (the node's
    short-lived helpers come and go between the listing and the look)."""
    try:
        return psutil.Process(pid).cmdline()
    except psutil.NoSuchProcess:
        return []
