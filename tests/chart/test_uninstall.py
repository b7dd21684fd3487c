"""`helm uninstall` leaves nothing stuck: with the real helm and the chart's operator running
from the registry's image on a real node, jobs deleted after the uninstall go with their pods
(containers on a real spot node), and a namespace holding a job goes too. Kueue runs beside
it: the uninstall leaves Kueue's objects alone, and a queued job deleted afterwards takes its
Workload and its quota with it.

The trainers are stand-ins in the trainer image that wait until SIGTERM and then exit, as a
trainer does once it has saved: this module is about finalizers and deletion, not training,
and two trainers training all along would take the machine's cores from other runs."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from tardigrade_local.realcluster import OPERATOR_NAMESPACE, OPERATOR_RELEASE
from tardigrade_operator.decision import queueing

from tests.chart.test_helm import _helm
from tests.e2e.harness import (
    NEEDS_REAL_NODES,
    OPERATOR_SELECTOR,
    Cluster,
    RealCluster,
    real_cluster,
    wait_for,
)

pytestmark = [
    pytest.mark.slow,
    # One test carries the module's cluster start, the install, the image pulls and the waits.
    pytest.mark.timeout(1200),
    NEEDS_REAL_NODES,
]

RELEASE, SYSTEM = OPERATOR_RELEASE, OPERATOR_NAMESPACE
KUEUE = (queueing.GROUP, queueing.VERSION)
TRACKING = "tardigrade.dev/gang-tracking"
# Waits until SIGTERM, then exits 0.
STAND_IN = ["python3", "-c", "import signal, sys; "
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); signal.pause()"]
# The trainer image's first pull on the spot node, on a machine other runs share.
RUNNING_TIMEOUT_SECONDS = 480.0
GONE_TIMEOUT_SECONDS = 240.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    """Kueue's manager, one on-demand node (the operator's), one spot node (the trainers');
    the CRD is helm's to install (none is preloaded to conflict with)."""
    with real_cluster(tmp_path_factory.mktemp("uninst"), 1, kueue=True) as running:
        yield running


def helm(cluster: Cluster, *args: str) -> str:
    result = subprocess.run([_helm(), *args], env=cluster.env, capture_output=True, text=True,
                            timeout=420)
    if result.returncode != 0:
        hook = cluster.kubectl("-n", SYSTEM, "logs", f"{RELEASE}-uninstall", check=False)
        raise AssertionError(f"{result.stderr}\nuninstall hook log:\n{hook[-3000:]}")
    return result.stdout


def pods_of(cluster: Cluster, namespace: str, job: str) -> list[Any]:
    return cluster.core.list_namespaced_pod(
        namespace, label_selector=f"tardigrade.dev/job={job}").items


def running(cluster: Cluster, namespace: str, job: str) -> bool:
    found = cluster.custom.get_namespaced_custom_object(
        "tardigrade.dev", "v1alpha1", namespace, "trainingjobs", job)
    return (found.get("status") or {}).get("phase") == "Running"


def what_happened(cluster: Cluster, namespace: str, job: str) -> str:
    """The job's status, its pods' states and its Workloads' conditions, for a failure."""
    found = cluster.custom.get_namespaced_custom_object(
        "tardigrade.dev", "v1alpha1", namespace, "trainingjobs", job)
    pods = {p.metadata.name: [c.state.to_dict() for c in p.status.container_statuses or []]
            or p.status.conditions for p in pods_of(cluster, namespace, job)}
    workloads = [(w.get("status") or {}).get("conditions") for w in
                 cluster.custom.list_namespaced_custom_object(
                     *KUEUE, namespace, "workloads",
                     label_selector=f"tardigrade.dev/job={job}")["items"]]
    logs = cluster.kubectl("-n", SYSTEM, "logs", "--tail=40", "-l", OPERATOR_SELECTOR,
                           check=False)
    return (f"status: {found.get('status')}\npods: {pods}\nworkloads: {workloads}\n"
            f"operator:\n{logs}")


def namespace_gone(cluster: Cluster, name: str) -> bool:
    try:
        cluster.core.read_namespace(name)
    except ApiException as err:
        return err.status == 404
    return False


def install_a_queue(cluster: Cluster) -> None:
    meta = {"apiVersion": "kueue.x-k8s.io/v1beta2"}
    cluster.custom.create_cluster_custom_object(*KUEUE, "resourceflavors", {
        **meta, "kind": "ResourceFlavor", "metadata": {"name": "default"}})
    cluster.custom.create_cluster_custom_object(*KUEUE, "clusterqueues", {
        **meta, "kind": "ClusterQueue", "metadata": {"name": "team"},
        "spec": {"namespaceSelector": {}, "resourceGroups": [{
            "coveredResources": ["cpu", "memory"],
            "flavors": [{"name": "default", "resources": [
                {"name": "cpu", "nominalQuota": "8"},
                {"name": "memory", "nominalQuota": "32Gi"}]}]}]}})
    cluster.custom.create_namespaced_custom_object(*KUEUE, "default", "localqueues", {
        **meta, "kind": "LocalQueue", "metadata": {"name": "team", "namespace": "default"},
        "spec": {"clusterQueue": "team"}})


def kueue_objects(cluster: Cluster) -> dict[str, list[str]]:
    custom = cluster.custom
    listed = {
        "resourceflavors": custom.list_cluster_custom_object(*KUEUE, "resourceflavors"),
        "clusterqueues": custom.list_cluster_custom_object(*KUEUE, "clusterqueues"),
        "localqueues": custom.list_namespaced_custom_object(*KUEUE, "default", "localqueues"),
    }
    return {kind: [o["metadata"]["name"] for o in found["items"]]
            for kind, found in listed.items()}


def quota_used(cluster: Cluster) -> str:
    """The cpu the ClusterQueue `team` has reserved."""
    queue = cluster.custom.get_cluster_custom_object(*KUEUE, "clusterqueues", "team")
    usage = (queue.get("status") or {}).get("flavorsReservation") or [{}]
    return str(next((r["total"] for r in usage[0].get("resources") or []
                     if r["name"] == "cpu"), "0"))


def workloads_of(cluster: Cluster, job: str) -> list[dict[str, Any]]:
    return list(cluster.custom.list_namespaced_custom_object(
        *KUEUE, "default", "workloads", label_selector=f"tardigrade.dev/job={job}")["items"])


def test_after_uninstall_jobs_and_their_namespace_can_be_deleted(cluster: RealCluster):
    install_a_queue(cluster)
    cluster.kubectl("create", "namespace", "ml")
    # One standalone replica, its image from the registry (`helm install ... --wait`).
    cluster.real.install_operator()
    [operator] = [p for p in cluster.core.list_namespaced_pod(
        SYSTEM, label_selector=OPERATOR_SELECTOR).items if p.status.phase == "Running"]
    repository = cluster.real.images["operator"].rsplit(":", 1)[0]
    assert operator.status.container_statuses[0].image_id.startswith(f"{repository}@sha256:")
    jobs = {"default": "kept", "ml": "in-ml"}
    for namespace, name in jobs.items():
        job = cluster.trainingjob(name, steps=100000, replicas=1, command=STAND_IN)
        job["metadata"]["namespace"] = namespace
        if name == "kept":  # admitted by Kueue
            job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team"}
        cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(job))
    for namespace, name in jobs.items():
        try:
            wait_for(lambda ns=namespace, n=name: running(cluster, ns, n),
                     RUNNING_TIMEOUT_SECONDS, f"{name} Running", interval=1)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{what_happened(cluster, namespace, name)}") from None
        [pod] = pods_of(cluster, namespace, name)
        assert pod.metadata.finalizers == [TRACKING]
        assert pod.status.container_statuses[0].container_id.startswith("containerd://")
    kueue_before = kueue_objects(cluster)
    [admitted] = workloads_of(cluster, "kept")
    wait_for(lambda: quota_used(cluster) != "0", 60, "kept's quota in use", interval=1)

    out = helm(cluster, "uninstall", RELEASE, "-n", SYSTEM, "--timeout", "400s")
    assert "uninstalled" in out
    # The hook scaled the operator to zero and waited for its pod to go before it returned.
    assert cluster.core.list_namespaced_pod(SYSTEM, label_selector=OPERATOR_SELECTOR).items == []
    # The hook's own pod, deleted by helm once it succeeded, goes as the kubelet confirms it.
    wait_for(lambda: not cluster.core.list_namespaced_pod(SYSTEM).items, GONE_TIMEOUT_SECONDS,
             f"every pod of {SYSTEM} gone", interval=1)
    # The trainers run on without an operator; the hook took the finalizer off their pods.
    for namespace, name in jobs.items():
        [pod] = pods_of(cluster, namespace, name)
        assert not pod.metadata.finalizers and not pod.metadata.deletion_timestamp
        assert pod.status.phase == "Running", pod.status

    # Kueue's objects are not the chart's: all there, kept's Workload still admitted.
    assert kueue_objects(cluster) == kueue_before
    [workload] = workloads_of(cluster, "kept")
    assert workload["metadata"]["uid"] == admitted["metadata"]["uid"]
    assert quota_used(cluster) != "0"

    cluster.kubectl("delete", "tj", "kept", "--timeout=60s")
    wait_for(lambda: not pods_of(cluster, "default", "kept"), GONE_TIMEOUT_SECONDS,
             "kept's pod to go", interval=1)
    # Its Workload goes with it (owned by the job), and the quota with the Workload.
    wait_for(lambda: not workloads_of(cluster, "kept") and quota_used(cluster) == "0", 120,
             "kept's Workload and quota gone", interval=1)
    cluster.kubectl("delete", "namespace", "ml", "--wait=false")
    wait_for(lambda: namespace_gone(cluster, "ml"), GONE_TIMEOUT_SECONDS, "namespace ml to go",
             interval=1)
    # The CRD stays (helm.sh/resource-policy: keep), so do other jobs' definitions.
    assert "trainingjobs.tardigrade.dev" in cluster.kubectl("get", "crd", "-o", "name")
