"""`helm uninstall` leaves nothing stuck: with the real helm and the chart's operator running
in the local cluster, jobs deleted after the uninstall go with their pods, and a namespace
holding a job goes too. Kueue runs beside it: the uninstall leaves Kueue's objects alone, and a
queued job deleted afterwards takes its Workload and its quota with it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from tardigrade_local.cluster import LocalCluster

from tests.chart.test_helm import CHART, _helm
from tests.e2e.harness import Cluster, trainingjob, wait_for
from tests.e2e.test_kueue import KUEUE, quota_used

pytestmark = pytest.mark.slow

RELEASE, SYSTEM = "tardigrade", "tardigrade-system"
TRACKING = "tardigrade.dev/gang-tracking"


def helm(cluster: Cluster, *args: str) -> str:
    result = subprocess.run([_helm(), *args], env=cluster.env, capture_output=True, text=True,
                            timeout=300)
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


def workloads_of(cluster: Cluster, job: str) -> list[dict[str, Any]]:
    return list(cluster.custom.list_namespaced_custom_object(
        *KUEUE, "default", "workloads", label_selector=f"tardigrade.dev/job={job}")["items"])


def test_after_uninstall_jobs_and_their_namespace_can_be_deleted(tmp_path: Path):
    # helm installs the CRD (no preloaded copy to conflict with), one standalone replica.
    with LocalCluster(tmp_path / "cluster", nodes=2, load_repo_crds=False, kueue=True) as local:
        cluster = Cluster(local, trainer_token_review=False)
        install_a_queue(cluster)
        for namespace in (SYSTEM, "ml"):
            cluster.kubectl("create", "namespace", namespace)
        helm(cluster, "install", RELEASE, str(CHART), "-n", SYSTEM, "--set", "replicaCount=1",
             "--set", "leaderElection.enabled=false", "--wait", "--timeout", "180s")
        jobs = {"default": "kept", "ml": "in-ml"}
        for namespace, name in jobs.items():
            job = trainingjob(name, steps=100000, replicas=1)
            job["metadata"]["namespace"] = namespace
            if name == "kept":  # admitted by Kueue
                job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team"}
            cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(job))
        for namespace, name in jobs.items():
            wait_for(lambda ns=namespace, n=name: running(cluster, ns, n), 240, f"{name} Running")
            assert pods_of(cluster, namespace, name)[0].metadata.finalizers == [TRACKING]
        kueue_before = kueue_objects(cluster)
        [admitted] = workloads_of(cluster, "kept")
        wait_for(lambda: quota_used(cluster) != "0", 30, "kept's quota in use")

        out = helm(cluster, "uninstall", RELEASE, "-n", SYSTEM, "--timeout", "180s")
        assert "uninstalled" in out
        assert cluster.core.list_namespaced_pod(SYSTEM).items == []
        # The trainers run on without an operator; the hook took the finalizer off their pods.
        for namespace, name in jobs.items():
            [pod] = pods_of(cluster, namespace, name)
            assert not pod.metadata.finalizers and not pod.metadata.deletion_timestamp

        # Kueue's objects are not the chart's: all there, kept's Workload still admitted.
        assert kueue_objects(cluster) == kueue_before
        [workload] = workloads_of(cluster, "kept")
        assert workload["metadata"]["uid"] == admitted["metadata"]["uid"]
        assert quota_used(cluster) != "0"

        cluster.kubectl("delete", "tj", "kept", "--timeout=30s")
        wait_for(lambda: not pods_of(cluster, "default", "kept"), 120, "kept's pod to go")
        # Its Workload goes with it (owned by the job), and the quota with the Workload.
        wait_for(lambda: not workloads_of(cluster, "kept") and quota_used(cluster) == "0", 60,
                 "kept's Workload and quota gone")
        cluster.kubectl("delete", "namespace", "ml", "--wait=false")
        wait_for(lambda: namespace_gone(cluster, "ml"), 180, "namespace ml to go")
        # The CRD stays (helm.sh/resource-policy: keep), so do other jobs' definitions.
        assert "trainingjobs.tardigrade.dev" in cluster.kubectl("get", "crd", "-o", "name")
