"""Kueue's workload slices (ElasticJobsViaWorkloadSlices, beta and on by default since v0.18)
for Workloads a TrainingJob owns, with real Kueue v0.19.2 and no operator: the Workloads are
written here as the operator would write them, to find out what Kueue itself does with them
(docs/kueue.md, "Growing a running gang"). A Workload that names the admitted one it replaces
(`kueue.x-k8s.io/workload-slice-replacement-for`) is admitted at the larger size with the
replaced one's quota counted as its own, which Kueue then finishes (`WorkloadSliceReplaced`);
one that does not fit waits while the replaced one stays admitted.

No pod ever runs here (no operator, and Kueue admits by a ClusterQueue's quota, not by
nodes), so the cluster has no node at all: the API server and Kueue are all it needs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from tardigrade_local import gobuild
from tardigrade_local.cluster import LocalCluster
from tardigrade_operator.decision import queueing

from tests.e2e.harness import NAMESPACE, Cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    gobuild.kueue_module().name == "kueue-v0.17",
    reason="workload slices are alpha and off in Kueue v0.17")]

KUEUE = ("kueue.x-k8s.io", "v1beta2")
QUEUE = "slices-queue"
REPLACES = "kueue.x-k8s.io/workload-slice-replacement-for"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("kslices")
    with LocalCluster(root / "cluster", nodes=0, with_gcs=False, kueue=True) as local:
        cluster = Cluster(local)
        meta = {"apiVersion": "kueue.x-k8s.io/v1beta2"}
        cluster.custom.create_cluster_custom_object(*KUEUE, "resourceflavors", {
            **meta, "kind": "ResourceFlavor", "metadata": {"name": "default"}})
        cluster.custom.create_cluster_custom_object(*KUEUE, "clusterqueues", {
            **meta, "kind": "ClusterQueue", "metadata": {"name": "slices"},
            "spec": {"namespaceSelector": {}, "resourceGroups": [{
                "coveredResources": ["cpu"], "flavors": [{"name": "default", "resources": [
                    {"name": "cpu", "nominalQuota": "4"}]}]}]}})
        cluster.custom.create_namespaced_custom_object(*KUEUE, NAMESPACE, "localqueues", {
            **meta, "kind": "LocalQueue", "metadata": {"name": QUEUE, "namespace": NAMESPACE},
            "spec": {"clusterQueue": "slices"}})
        yield cluster


def training_job(cluster: Cluster, name: str) -> queueing.JobIdentity:
    """A TrainingJob no operator runs (none is started here): the Workloads' owner."""
    cluster.apply({
        "apiVersion": "tardigrade.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"replicas": 1, "image": "trainer:1", "suspend": True,
                 "checkpoint": {"path": f"gs://bucket/{name}"}}})
    job = cluster.job(name)
    assert job is not None
    return queueing.JobIdentity(name, NAMESPACE, job["metadata"]["uid"])


def workload(job: queueing.JobIdentity, name: str, count: int,
             annotations: dict[str, str] | None = None) -> dict[str, Any]:
    body = {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": name, "namespace": NAMESPACE,
                     "labels": {queueing.JOB_UID_LABEL: job.uid},
                     "annotations": dict(annotations or {}),
                     "ownerReferences": [{
                         "apiVersion": "tardigrade.dev/v1alpha1", "kind": "TrainingJob",
                         "name": job.name, "uid": job.uid, "controller": True}]},
        "spec": {"queueName": QUEUE, "podSets": [{
            "name": queueing.PODSET, "count": count, "template": {"spec": {
                "restartPolicy": "Never", "containers": [{
                    "name": "trainer", "image": "trainer:1",
                    "resources": {"requests": {"cpu": "1"}}}]}}}]},
    }
    return body


def read(cluster: Cluster, name: str) -> dict[str, Any]:
    return cluster.custom.get_namespaced_custom_object(*KUEUE, NAMESPACE, "workloads", name)


def condition(body: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (body.get("status") or {}).get("conditions") or []
                 if c["type"] == kind), {})


def used(cluster: Cluster) -> str:
    queue = cluster.custom.get_cluster_custom_object(*KUEUE, "clusterqueues", "slices")
    usage = (queue.get("status") or {}).get("flavorsReservation") or [{}]
    return str(next((r["total"] for r in usage[0].get("resources") or []
                     if r["name"] == "cpu"), "0"))


def test_a_replacement_slice_is_admitted_with_the_replaced_ones_quota_and_finishes_it(
        cluster: Cluster):
    job = training_job(cluster, "grown")
    create = cluster.custom.create_namespaced_custom_object
    create(*KUEUE, NAMESPACE, "workloads", workload(job, "grown-a", 3))
    wait_for(lambda: condition(read(cluster, "grown-a"), "Admitted").get("status") == "True",
             60, "the first slice admitted")
    wait_for(lambda: used(cluster) == "3", 60, "usage of the first slice")
    # 3 + 5 > 4 and 5 > 4: waits, and the first slice keeps its admission.
    create(*KUEUE, NAMESPACE, "workloads", workload(
        job, "grown-b", 5, {REPLACES: f"{NAMESPACE}/grown-a"}))
    wait_for(lambda: condition(read(cluster, "grown-b"), "QuotaReserved").get(
        "reason") in ("Pending", "PendingEvaluation")
        and condition(read(cluster, "grown-b"), "QuotaReserved").get("message"), 60,
        "the too large slice pending with Kueue's reason")
    print("pending slice:", condition(read(cluster, "grown-b"), "QuotaReserved"))
    assert condition(read(cluster, "grown-a"), "Admitted").get("status") == "True"
    cluster.custom.delete_namespaced_custom_object(*KUEUE, NAMESPACE, "workloads", "grown-b")
    # 3 + 4 > 4, yet 4 fits once the replaced slice's 3 count as the new one's.
    create(*KUEUE, NAMESPACE, "workloads", workload(
        job, "grown-c", 4, {REPLACES: f"{NAMESPACE}/grown-a"}))
    wait_for(lambda: condition(read(cluster, "grown-c"), "Admitted").get("status") == "True",
             60, "the replacement slice admitted")
    finished = wait_for(lambda: (c := condition(read(cluster, "grown-a"), "Finished")).get(
        "status") == "True" and c, 60, "the replaced slice finished")
    print("replaced slice:", finished)
    assert finished["reason"] == "WorkloadSliceReplaced"
    wait_for(lambda: used(cluster) == "4", 60, "usage at the new size")
