"""`helm uninstall` leaves nothing stuck: with the real helm and the chart's operator running
in the local cluster, jobs deleted after the uninstall go with their pods, and a namespace
holding a job goes too."""

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


def test_after_uninstall_jobs_and_their_namespace_can_be_deleted(tmp_path: Path):
    # helm installs the CRD (no preloaded copy to conflict with), one standalone replica.
    with LocalCluster(tmp_path / "cluster", nodes=2, load_repo_crds=False) as local:
        cluster = Cluster(local, trainer_token_review=False)
        for namespace in (SYSTEM, "ml"):
            cluster.kubectl("create", "namespace", namespace)
        helm(cluster, "install", RELEASE, str(CHART), "-n", SYSTEM, "--set", "replicaCount=1",
             "--set", "leaderElection.enabled=false", "--wait", "--timeout", "180s")
        jobs = {"default": "kept", "ml": "in-ml"}
        for namespace, name in jobs.items():
            job = trainingjob(name, steps=100000, replicas=1)
            job["metadata"]["namespace"] = namespace
            cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(job))
        for namespace, name in jobs.items():
            wait_for(lambda ns=namespace, n=name: running(cluster, ns, n), 240, f"{name} Running")
            assert pods_of(cluster, namespace, name)[0].metadata.finalizers == [TRACKING]

        out = helm(cluster, "uninstall", RELEASE, "-n", SYSTEM, "--timeout", "180s")
        assert "uninstalled" in out
        assert cluster.core.list_namespaced_pod(SYSTEM).items == []
        # The trainers run on without an operator; the hook took the finalizer off their pods.
        for namespace, name in jobs.items():
            [pod] = pods_of(cluster, namespace, name)
            assert not pod.metadata.finalizers and not pod.metadata.deletion_timestamp

        cluster.kubectl("delete", "tj", "kept", "--timeout=30s")
        wait_for(lambda: not pods_of(cluster, "default", "kept"), 120, "kept's pod to go")
        cluster.kubectl("delete", "namespace", "ml", "--wait=false")
        wait_for(lambda: namespace_gone(cluster, "ml"), 180, "namespace ml to go")
        # The CRD stays (helm.sh/resource-policy: keep), so do other jobs' definitions.
        assert "trainingjobs.tardigrade.dev" in cluster.kubectl("get", "crd", "-o", "name")
