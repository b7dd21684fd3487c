"""A real node in the local cluster: the kubelet and containerd built from the pinned modules
run a pod as a container, its log comes back through kube-apiserver, and stopping the node
leaves nothing on the machine."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys

import pytest
from kube_helpers import Kube, condition, container_status, kubectl, wait_for
from kubernetes.utils import parse_quantity
from tardigrade_local import gobuild, nodeimage
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.gke.nodes import NODE_POOL_LABEL, NodeConfig
from tardigrade_local.gke.tpuslices import (
    SPOT_LABEL,
    TPU_ACCELERATOR_LABEL,
    TPU_RESOURCE,
    TPU_TAINT,
    TPU_TOPOLOGY_LABEL,
)
from tardigrade_local.realnode import RealNode, sweep_orphans

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                       reason="a real node needs Linux and root (namespaces, mounts, cgroups)"),
]

NODE = "real-node-1"
POD_TIMEOUT_SECONDS = 180.0


# A process that starts a real node and is then killed before it can stop it.
NODE_OWNER = """
import json, sys, time
from pathlib import Path
from tardigrade_local.realnode import RealNode
RealNode.for_cluster(json.loads(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), index=2).start()
print("ready", flush=True)
time.sleep(3600)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    sweep_orphans()  # what a killed earlier run left on this machine
    state = tmp_path_factory.mktemp("realnode") / "state"
    with LocalCluster(state, nodes=[], with_gcs=False, node_egress=True) as running:
        yield running


@pytest.fixture(scope="module")
def node(cluster, tmp_path_factory):
    real = RealNode.for_cluster(cluster.info, NODE, tmp_path_factory.mktemp("node"))
    with real:
        yield real


@pytest.fixture(scope="module")
def kube(cluster):
    return Kube(str(cluster.kubeconfig))


def test_the_node_registers_with_the_pinned_kubelet_and_containerd_and_is_ready(node, kube):
    def ready():
        found = kube.plain(kube.core.read_node(NODE))
        ready = [c for c in found["status"]["conditions"] if c["type"] == "Ready"]
        return found if ready and ready[0]["status"] == "True" else None

    found = wait_for(ready, POD_TIMEOUT_SECONDS, what=f"{NODE} Ready")
    info = found["status"]["nodeInfo"]
    assert info["kubeletVersion"] == gobuild.kubernetes_version() == "v1.36.3"
    containerd = gobuild.CONTAINERD.requirement("github.com/containerd/containerd/v2")
    assert info["containerRuntimeVersion"] == f"containerd://{containerd.lstrip('v')}"
    assert info["containerRuntimeVersion"] == "containerd://2.4.2"
    assert {"type": "InternalIP", "address": node.addresses.node_ip} in found["status"][
        "addresses"]


def test_a_pod_runs_as_a_container_and_its_log_comes_through_the_api_server(
        node, kube, cluster):
    kube.create_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hello"}, "spec": {
        "restartPolicy": "Never", "nodeSelector": {"kubernetes.io/hostname": NODE},
        "containers": [{
            "name": "main", "image": nodeimage.BUSYBOX_IMAGE, "imagePullPolicy": "Never",
            "command": ["sh", "-c",
                        "echo written by $(hostname); grep memory /proc/self/cgroup"]}]}})
    pod = kube.wait_phase("hello", ("Succeeded", "Failed"), timeout=POD_TIMEOUT_SECONDS)
    status = container_status(pod)
    assert pod["status"]["phase"] == "Succeeded", json.dumps(pod["status"], indent=2)
    assert pod["spec"]["nodeName"] == NODE
    assert status["containerID"].startswith("containerd://")
    assert status["state"]["terminated"]["exitCode"] == 0
    assert condition(pod, "PodScheduled")["status"] == "True"
    # The CNI bridge plugin gave it an address of the node's pod range.
    pod_ip = ipaddress.ip_address(pod["status"]["podIP"])
    assert pod_ip in ipaddress.ip_network(node.addresses.pod_cidr)
    # The container's runtime knows it by the same ID.
    container_id = status["containerID"].removeprefix("containerd://")
    assert container_id in node.crictl("ps", "--all", "--quiet")
    # kube-apiserver -> egress proxy -> the kubelet in the node's network namespace -> CRI.
    log = kubectl("logs", "hello", env=cluster.client_env())
    assert "written by hello" in log
    # ...and the container ran in the node's own cgroups.
    assert f":memory:{node.cgroup_root}/kubepods/besteffort/pod{pod['metadata']['uid']}/" in log


# A TPU host of a GKE node pool, as small as this machine allows (1 CPU, 1 GiB allocatable).
TPU_NODE = NodeConfig(
    "tpu-pool-1", labels={TPU_ACCELERATOR_LABEL: "tpu-v5-lite-podslice",
                          TPU_TOPOLOGY_LABEL: "2x4", SPOT_LABEL: "true"},
    taints=(TPU_TAINT,), capacity={"cpu": "1", "memory": "1Gi", "pods": "20",
                                   TPU_RESOURCE: "4"}, pool="tpu-pool")


def test_a_node_takes_its_pools_labels_taints_allocatable_and_tpu_chips(
        cluster, kube, tmp_path_factory):
    with RealNode.for_cluster(cluster.info, TPU_NODE.name, tmp_path_factory.mktemp("np"),
                              index=3, config=TPU_NODE):
        # Only the pool's taint once node lifecycle has taken its not-ready one off.
        found = wait_for(lambda: (node := kube.plain(kube.core.read_node(TPU_NODE.name)))[
            "spec"].get("taints") == [TPU_TAINT] and node, POD_TIMEOUT_SECONDS,
                         what=f"{TPU_NODE.name} tainted as its pool taints it")
        labels = found["metadata"]["labels"]
        assert {k: labels.get(k) for k in TPU_NODE.labels} == dict(TPU_NODE.labels)
        assert labels[NODE_POOL_LABEL] == "tpu-pool"
        assert labels["kubernetes.io/hostname"] == TPU_NODE.name  # the kubelet's own stay
        allocatable, capacity = found["status"]["allocatable"], found["status"]["capacity"]
        # The machine's figures are the capacity; the rest is reserved for the system.
        assert parse_quantity(allocatable["cpu"]) == 1
        assert parse_quantity(allocatable["memory"]) == 2**30
        assert parse_quantity(capacity["cpu"]) == os.cpu_count()
        assert allocatable["pods"] == capacity["pods"] == "20"
        assert capacity[TPU_RESOURCE] == allocatable[TPU_RESOURCE] == "4"
        # The node advertised the chips in its status capacity; their allocatable is the
        # kubelet's own doing, in a status update of its that kept them.
        kubelet_fields = [json.dumps(m.get("fieldsV1")) for m in found["metadata"][
            "managedFields"] if m["manager"] == "kubelet" and m.get("subresource") == "status"]
        assert any('"f:allocatable"' in f and f'"f:{TPU_RESOURCE}"' in f
                   for f in kubelet_fields), kubelet_fields
        # A TPU pod is admitted by the real kubelet and runs there; a second asking for more
        # chips than are left is not scheduled.
        for name, chips in (("tpu-user", "4"), ("tpu-greedy", "1")):
            kube.create_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                             "spec": {
                "restartPolicy": "Never", "nodeSelector": {NODE_POOL_LABEL: "tpu-pool"},
                "tolerations": [{"key": TPU_RESOURCE, "operator": "Exists",
                                 "effect": "NoSchedule"}],
                "containers": [{"name": "main", "image": nodeimage.BUSYBOX_IMAGE,
                                "imagePullPolicy": "Never", "command": ["sleep", "3600"],
                                "resources": {"limits": {TPU_RESOURCE: chips}}}]}})
        pod = kube.wait_phase("tpu-user", ("Running",), timeout=POD_TIMEOUT_SECONDS)
        assert pod["spec"]["nodeName"] == TPU_NODE.name
        wait_for(lambda: (condition(kube.pod("tpu-greedy") or {}, "PodScheduled") or {}
                          ).get("reason") == "Unschedulable", POD_TIMEOUT_SECONDS,
                 what="tpu-greedy unschedulable")
        for name in ("tpu-user", "tpu-greedy"):
            kube.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def test_the_nodes_of_a_killed_process_are_swept(cluster, kube, tmp_path_factory):
    # Not the test's own tmp_path: under pytest-xdist its path is too long for the kubelet's
    # sockets (RealNode refuses it, naming the limit).
    directory = tmp_path_factory.mktemp("orphan")
    owner = subprocess.Popen([sys.executable, "-c", NODE_OWNER, json.dumps(cluster.info),
                              "real-node-2", str(directory)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == "ready", "the node did not start"
        kube.create_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper"},
                         "spec": {"nodeSelector": {"kubernetes.io/hostname": "real-node-2"},
                                  "containers": [{"name": "main", "image": nodeimage.BUSYBOX_IMAGE,
                                                  "imagePullPolicy": "Never",
                                                  "command": ["sleep", "3600"]}]}})
        kube.wait_phase("sleeper", ("Running",), timeout=POD_TIMEOUT_SECONDS)
    finally:
        owner.kill()
        owner.wait()
    orphan = RealNode("real-node-2", directory, "", directory, index=2)
    # The kubelet and containerd died with their owner; the container and its shim did not.
    wait_for(lambda: orphan.leftovers()["processes"], what="the orphan's container")
    assert "real-node-2" in sweep_orphans()
    assert orphan.leftovers() == {"processes": [], "mounts": [], "cgroups": [],
                                  "log_links": [], "netns": [], "host_links": []}
    assert "real-node-2" not in sweep_orphans()


def test_stopping_the_node_leaves_nothing_behind(node):
    running = node.leftovers()
    assert running["processes"] and running["cgroups"] and running["netns"]
    assert running["log_links"], "the kubelet links the container's log in /var/log/containers"
    node.stop()
    assert node.leftovers() == {"processes": [], "mounts": [], "cgroups": [], "log_links": [],
                                "netns": [], "host_links": []}
    assert not node.netns_path.exists()
    assert not node.containerd_socket.exists()
