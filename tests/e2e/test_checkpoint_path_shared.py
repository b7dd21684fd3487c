"""A checkpoint path that is not shared between hosts stops the job at start, clearly, once.

On real nodes: the kubelet gives each pod its own emptyDir on its own node, so the trainer's
start-up probe meets the real failure (each host sees only the files it wrote itself); a
ReadWriteMany claim every node mounts is shared, and the job trains.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.harness import (
    NEEDS_REAL_NODES,
    InstalledOperator,
    RealCluster,
    real_cluster,
)

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_NODES,
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    with real_cluster(tmp_path_factory.mktemp("shared"), 2) as running:
        yield running


def _describe(cluster: RealCluster, job: str) -> str:
    """The job's status and its pods' last log lines, for a failure message."""
    parts = [f"status: {cluster.status(job)}"]
    for pod in cluster.pods(job):
        log = cluster.core.read_namespaced_pod_log(pod.metadata.name, "default")
        parts.append(f"--- {pod.metadata.name} on {pod.spec.node_name}: {pod.status.phase}\n"
                     + "\n".join(log.splitlines()[-15:]))
    return "\n".join(parts)


def test_empty_dir_checkpoints_fail_at_start_and_a_shared_path_trains(
        cluster: RealCluster, operator: InstalledOperator):
    name = "ckpt-emptydir"
    job = cluster.trainingjob(name, steps=6)
    job["spec"]["checkpoint"]["path"] = f"/ckpt/{name}"
    job["spec"]["podTemplate"]["volumes"] = [{"name": "ckpt", "emptyDir": {}}]
    job["spec"]["podTemplate"]["volumeMounts"] = [{"name": "ckpt", "mountPath": "/ckpt"}]
    cluster.apply(job)
    try:
        status = cluster.wait_phase(name, {"Failed"}, timeout=300)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{_describe(cluster, name)}") from None
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Failed"] == "CannotRun"
    message = status["message"]
    assert "exited with code 2 (ConfigError): spec.checkpoint.path" in message
    assert "is not shared between hosts" in message
    assert "ReadWriteMany PersistentVolumeClaim" in message and "gcsfuse" in message
    assert status["restarts"]["total"] == 0, status["restarts"]
    # The ranks ran on two nodes (their pods may be gone already: the operator stops a
    # rank that is still leaving once the other's exit code failed the job).
    events = cluster.core.list_namespaced_event("default").items
    nodes = {e.message.rsplit(" ", 1)[-1] for e in events if e.reason == "Scheduled"
             and e.involved_object.name.startswith(f"{name}-a1-")}
    assert len(nodes) == 2, nodes
    operator.assert_alive()

    name = "ckpt-shared"
    job = cluster.trainingjob(name, steps=6)
    # The cluster's ReadWriteMany claim, which every node mounts.
    in_pods, here = cluster.mount_shared_checkpoints(job)
    job["spec"]["checkpoint"]["path"] = f"{in_pods}/{name}"
    job["spec"]["checkpoint"]["interval"] = {"steps": 3}
    cluster.apply(job)
    try:
        status = cluster.wait_phase(name, {"Succeeded"}, timeout=420)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{_describe(cluster, name)}") from None
    assert status["lastCheckpoint"]["step"] == 6
    assert (here / name / "step_00000006" / "metadata.json").exists()
    assert not list((here / name).glob(".tardigrade-shared-probe-*"))
