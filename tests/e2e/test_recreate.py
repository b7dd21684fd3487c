"""End to end on real nodes: a TrainingJob deleted and re-created under its name, and a Service
name taken."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.harness import (
    NAMESPACE,
    NEEDS_REAL_NODES,
    InstalledOperator,
    RealCluster,
    real_cluster,
    wait_for,
)

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_NODES,
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    with real_cluster(tmp_path_factory.mktemp("recreate"), 2) as running:
        yield running


def _owner_uids(objects: list[object]) -> set[str]:
    return {ref.uid for o in objects for ref in (o.metadata.owner_references or [])}


HOLD = "tests.tardigrade.dev/hold"


def test_a_job_recreated_while_its_old_pods_terminate_adopts_none_of_them(
        cluster: RealCluster, operator: InstalledOperator):
    name = "e2e-recreate"
    cluster.apply(cluster.trainingjob(name, steps=100000))
    cluster.wait_phase(name, {"Running"}, timeout=300)
    old_uid = cluster.job(name)["metadata"]["uid"]
    old_pods = {f"{name}-a1-0", f"{name}-a1-1"}
    assert {p.metadata.name for p in cluster.pods(name)} == old_pods
    # Keep the old pod objects Terminating after their processes exit, as pods on a lost node
    # stay: the garbage collector deletes them, but they must outlive the re-creation.
    for pod in old_pods:
        cluster.core.patch_namespaced_pod(pod, NAMESPACE, [
            {"op": "add", "path": "/metadata/finalizers/-", "value": HOLD}])

    # The job goes at once (no finalizer); the garbage collector deletes its pods gracefully
    # (the trainers save on SIGTERM) and its Service. Re-create it before they are gone.
    cluster.kubectl("delete", "tj", name, "--wait=false")
    wait_for(lambda: cluster.job(name) is None, 30, "the old job to be gone")
    cluster.apply(cluster.trainingjob(name, steps=100000))
    new_uid = cluster.job(name)["metadata"]["uid"]
    assert new_uid != old_uid

    status = cluster.wait_phase(name, {"Running"}, timeout=300)
    operator.assert_alive()
    pods = {p.metadata.name: p for p in cluster.pods(name)}
    new_pods = {n for n, p in pods.items() if _owner_uids([p]) == {new_uid}}
    # Named after the old attempts, so no create collided with a lingering old pod.
    assert new_pods == {f"{name}-a2-0", f"{name}-a2-1"}
    assert status["attempt"] == 2 and status["restarts"]["total"] == 0
    assert status["replicas"] == 2
    for pod in old_pods:  # still there, untouched: deleted by the garbage collector, not us
        assert pods[pod].metadata.deletion_timestamp is not None
        assert _owner_uids([pods[pod]]) <= {old_uid}
    service = cluster.core.read_namespaced_service(name, NAMESPACE)
    assert _owner_uids([service]) == {new_uid}

    for pod in old_pods:
        held = cluster.core.read_namespaced_pod(pod, NAMESPACE).metadata.finalizers
        cluster.core.patch_namespaced_pod(pod, NAMESPACE, [
            {"op": "remove", "path": f"/metadata/finalizers/{held.index(HOLD)}"}])
    cluster.kubectl("delete", "tj", name, "--wait=false")
    wait_for(lambda: not cluster.pods(name), 120, "the pods to go")


def test_a_service_of_someone_else_with_the_jobs_name_fails_the_job_naming_it(
        cluster: RealCluster, operator: InstalledOperator):
    name = "e2e-taken"
    cluster.core.create_namespaced_service(NAMESPACE, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}})
    cluster.apply(cluster.trainingjob(name, steps=10))
    status = cluster.wait_phase(name, {"Failed"}, timeout=60)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Failed"]["reason"] == "ServiceNameTaken"
    assert conditions["Stalled"]["status"] == "True"
    assert f"Service {NAMESPACE}/{name}" in status["message"]
    assert f"kubectl delete service -n {NAMESPACE} {name}" in status["message"]
    assert cluster.pods(name) == []
    events = cluster.kubectl("get", "events", "--field-selector",
                             f"involvedObject.name={name},reason=ServiceNameTaken")
    assert "ServiceNameTaken" in events
    cluster.kubectl("delete", "tj", name)
    cluster.core.delete_namespaced_service(name, NAMESPACE)
