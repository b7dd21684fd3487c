"""TrainingJobs placed by Kueue's Topology Aware Scheduling (real Kueue v0.19.2, its TAS beta
and on by default since v0.14, nothing set in its Configuration for it), on real nodes (real
kubelets v1.36.3 and containerd) with the chart's operator and real trainers of the
registry's trainer image: a ResourceFlavor names a Topology of two levels (a block label and
kubernetes.io/hostname) over four labelled nodes of one CPU each (their pool's allocatable,
`nodeshape.py`); a job that asks for one block gets a Workload whose podSet carries that
`topologyRequest`, its pods are created behind Kueue's scheduling gate, and Kueue's ungater
puts each rank on the node the Workload's `topologyAssignment` gives it, in the one block
where the gang fits, again when it relaunches under the same admission (a shrink); a gang no
block holds waits in phase Queued with Kueue's reason though quota and nodes would take it.
The operator runs on a node of another pool, outside the flavor."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from tardigrade_local.gke.nodes import NodeConfig
from tardigrade_local.kueue import WaitForPodsReady
from tardigrade_operator import naming
from tardigrade_operator.decision import queueing

from tests.e2e.harness import (
    NAMESPACE,
    NEEDS_REAL_NODES,
    InstalledOperator,
    RealCluster,
    real_cluster,
    wait_for,
)

pytestmark = [pytest.mark.slow, NEEDS_REAL_NODES]

KUEUE = ("kueue.x-k8s.io", "v1beta2")
QUEUE = "tas-queue"
BLOCK = "example.com/block"
HOSTNAME = "kubernetes.io/hostname"
POOL_LABEL = "cloud.google.com/gke-nodepool"
# Block b1 holds one node, b2 three: a gang of two that must share a block fits only in b2,
# where the default scheduler alone would put a rank on the first node as readily.
NODES = {"tas-1": "b1", "tas-2": "b2", "tas-3": "b2", "tas-4": "b2"}
# One CPU a node, as the simulated nodes had: one rank each.
TAS_CAPACITY = {"cpu": "1", "memory": "4Gi", "pods": "20"}
# The operator's node: another pool, outside the ResourceFlavor's nodeLabels.
OPERATOR_NODE = NodeConfig("real-1", pool="system", capacity={"cpu": "1", "memory": "4Gi",
                                                               "pods": "20"})
# The chart's nodeSelector keeps the operator there: on a block's node its requests would
# leave less than a rank's CPU.
OPERATOR_HELM_VALUES = ("--set", "nodeSelector.cloud\\.google\\.com/gke-nodepool=system")
# Image pulls of the 1 GB trainer, JAX's start and compile, on a shared 2-core machine.
RUNNING_SECONDS = 600


def kueue_objects() -> list[tuple[str, dict[str, Any]]]:
    meta = {"apiVersion": "kueue.x-k8s.io/v1beta2"}
    return [
        ("topologies", {**meta, "kind": "Topology", "metadata": {"name": "blocks"},
                        "spec": {"levels": [{"nodeLabel": BLOCK}, {"nodeLabel": HOSTNAME}]}}),
        ("resourceflavors", {**meta, "kind": "ResourceFlavor", "metadata": {"name": "tas"},
                             "spec": {"nodeLabels": {POOL_LABEL: "default-pool"},
                                      "topologyName": "blocks"}}),
        ("clusterqueues", {**meta, "kind": "ClusterQueue", "metadata": {"name": "tas"},
                           "spec": {"namespaceSelector": {}, "resourceGroups": [{
                               "coveredResources": ["cpu", "memory"],
                               "flavors": [{"name": "tas", "resources": [
                                   {"name": "cpu", "nominalQuota": "4"},
                                   # Never the limit: the CPUs are what the test counts.
                                   {"name": "memory", "nominalQuota": "16Gi"}]}]}]}}),
    ]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    nodes = [OPERATOR_NODE, *(NodeConfig(name, labels={BLOCK: block}, capacity=TAS_CAPACITY)
                              for name, block in NODES.items())]
    with real_cluster(tmp_path_factory.mktemp("tas"), 0, kueue=True, nodes=nodes,
                      kueue_wait_for_pods_ready=WaitForPodsReady(
                          timeout_seconds=RUNNING_SECONDS)) as cluster:
        for plural, body in kueue_objects():
            cluster.custom.create_cluster_custom_object(*KUEUE, plural, body)
        cluster.custom.create_namespaced_custom_object(*KUEUE, NAMESPACE, "localqueues", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
            "metadata": {"name": QUEUE, "namespace": NAMESPACE},
            "spec": {"clusterQueue": "tas"}})
        yield cluster


def job(cluster: RealCluster, name: str, replicas: int, topology: dict[str, str]
        ) -> dict[str, Any]:
    """A real trainer that runs until deleted, one rank a node (a CPU each), wherever Kueue
    puts it (no spot node selector: Kueue's ungater gives the nodeSelector)."""
    body = cluster.trainingjob(name, steps=100_000, replicas=replicas)
    body["metadata"]["labels"] = {queueing.QUEUE_LABEL: QUEUE}
    spec = body["spec"]
    # Not elastic, as the simulated gangs were: a gang no block holds must wait, not shrink.
    spec.pop("minReplicas", None)
    spec.pop("maxReplicas", None)
    spec["resources"]["requests"] = {"cpu": "1", "memory": "256Mi"}
    spec["topology"] = topology
    spec["checkpoint"]["interval"] = {"steps": 1000}
    spec["failurePolicy"] = {"backoffSeconds": 0}
    spec["podTemplate"] = {"terminationGracePeriodSeconds": 30}
    return body


def workload_of(cluster: RealCluster, name: str) -> dict[str, Any] | None:
    listed = cluster.custom.list_namespaced_custom_object(*KUEUE, NAMESPACE, "workloads")
    return next((w for w in listed["items"]
                 if w["metadata"]["labels"].get("tardigrade.dev/job") == name), None)


def assignment(workload: dict[str, Any] | None) -> queueing.TopologyAssignment | None:
    admission = ((workload or {}).get("status") or {}).get("admission") or {}
    for podset in admission.get("podSetAssignments") or []:
        if podset.get("name") == queueing.PODSET and podset.get("topologyAssignment"):
            return queueing.parse_topology_assignment(podset["topologyAssignment"])
    return None


def test_a_gang_asking_for_one_block_runs_where_kueues_topology_assignment_puts_each_rank(
        cluster: RealCluster, operator: InstalledOperator):
    cluster.apply(job(cluster, "blocked", replicas=2, topology={"required": BLOCK}))
    workload = wait_for(lambda: workload_of(cluster, "blocked"), 60, "the Workload")
    request = workload["spec"]["podSets"][0]["topologyRequest"]
    assert request == {"required": BLOCK, "podIndexLabel": naming.LABEL_RANK}
    placed = wait_for(lambda: assignment(workload_of(cluster, "blocked")), 120,
                      "Kueue's topologyAssignment")
    # Down to the node: Kueue writes only the hostname level then (`utiltas`,
    # `NodeNameFromDomainID`), the block is the node's.
    assert placed.levels[-1] == HOSTNAME
    assert placed.pods == 2
    hosts = [values[-1] for values, _ in placed.domains]
    assert {NODES[host] for host in hosts} == {"b2"}, placed
    cluster.wait_phase("blocked", {"Running"}, RUNNING_SECONDS)
    pods = {int(p.metadata.labels[naming.LABEL_RANK]): p for p in cluster.pods("blocked")}
    assert sorted(pods) == [0, 1]
    for rank, pod in pods.items():
        wanted = placed.node_labels(rank)
        assert wanted is not None
        # Kueue's ungater took the gate off and gave the rank its domain's node labels.
        assert not pod.spec.scheduling_gates
        assert pod.metadata.annotations[queueing.WORKLOAD_ANNOTATION] == workload[
            "metadata"]["name"]
        assert pod.metadata.annotations[queueing.REQUIRED_TOPOLOGY] == BLOCK
        assert {k: pod.spec.node_selector[k] for k in wanted} == wanted
        assert pod.spec.node_name == wanted[HOSTNAME]
        assert NODES[pod.spec.node_name] == "b2"
    assert len({p.spec.node_name for p in pods.values()}) == 2
    operator.assert_alive()
    cluster.clear_jobs()


def test_a_gang_no_block_holds_waits_in_kueues_words_though_the_quota_would_do(
        cluster: RealCluster, operator: InstalledOperator):
    """Four ranks fit the quota and the nodes, not one block: required means it waits."""
    cluster.apply(job(cluster, "wide", replicas=4, topology={"required": BLOCK}))
    status = wait_for(lambda: (s := cluster.status("wide")).get("phase") == "Queued"
                      and "allows to fit only" in s.get("message", "") and s, 90,
                      "Kueue's TAS reason in the status")
    assert "blocks" in status["message"]
    assert not cluster.pods("wide")
    assert assignment(workload_of(cluster, "wide")) is None
    operator.assert_alive()
    cluster.clear_jobs()


def test_a_gang_relaunched_under_its_admission_is_placed_by_the_assignment_again(
        cluster: RealCluster, operator: InstalledOperator):
    """A shrink relaunches the gang under the same admitted Workload: the new attempt's pods
    are gated again and Kueue's ungater puts each rank where the assignment says."""
    cluster.apply(job(cluster, "shrunk", replicas=3, topology={"required": BLOCK}))
    first = cluster.wait_phase("shrunk", {"Running"}, RUNNING_SECONDS)
    placed = assignment(workload_of(cluster, "shrunk"))
    assert placed is not None and placed.pods == 3
    cluster.kubectl("scale", "trainingjob", "shrunk", "--replicas=2", "-n", NAMESPACE)

    def relaunched() -> list[Any] | None:
        status = cluster.status("shrunk")
        pods = [p for p in cluster.pods("shrunk")
                if p.metadata.labels[naming.LABEL_ATTEMPT] == str(status.get("attempt"))
                and p.status.phase == "Running" and not p.metadata.deletion_timestamp]
        ok = status.get("phase") == "Running" and status.get("attempt") > first["attempt"]
        return pods if ok and len(pods) == 2 else None

    pods = wait_for(relaunched, RUNNING_SECONDS, "the gang of 2 running in a new attempt")
    assert cluster.status("shrunk")["recoveries"][-1]["cause"] == "Resize"
    # The same admission: the Workload and its assignment are unchanged.
    assert assignment(workload_of(cluster, "shrunk")) == placed
    for pod in pods:
        wanted = placed.node_labels(int(pod.metadata.labels[naming.LABEL_RANK]))
        assert wanted is not None and pod.spec.node_name == wanted[HOSTNAME]
        assert not pod.spec.scheduling_gates
    operator.assert_alive()
    cluster.clear_jobs()
