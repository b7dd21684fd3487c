"""Specs the cluster will not run: children the API server refuses, containers that never start."""

from __future__ import annotations

from tests.operator.fake_cluster import FakeCluster, spec


def test_refused_pod_fails_the_job_once_and_stops_the_gang():
    cluster = FakeCluster(spec())
    cluster.reconcile()
    cluster.run_all()
    cluster.rejected = ("the API server rejected Pod tiny-a1-1: metadata.annotations: Too long: "
                        "must have at most 262144 bytes")
    plan = cluster.reconcile()
    assert cluster.status.phase == "Failed"
    assert "metadata.annotations: Too long" in cluster.status.message
    assert sorted(name for name, _ in plan.delete_pods) == ["tiny-a1-0", "tiny-a1-1"]
    assert [e.reason for e in plan.events] == ["PodRejected"]
    assert {c.type: c.reason for c in cluster.status.conditions}["Failed"] == "PodRejected"
    # Terminal: no relaunch, no second event, and no restart budget spent.
    again = cluster.reconcile()
    assert again.create_pods == [] and again.events == []
    assert cluster.status.restarts.total == 0


def _stuck(cluster: FakeCluster, reason: str, message: str) -> None:
    for pod in cluster.attempt_pods():
        pod["status"] = {"phase": "Pending", "containerStatuses": [
            {"name": "trainer", "state": {"waiting": {"reason": reason, "message": message}}}]}


def test_image_pull_failure_is_explained_in_status_and_one_event():
    cluster = FakeCluster(spec())
    cluster.reconcile()
    _stuck(cluster, "ImagePullBackOff", 'Back-off pulling image "ghcr.io/org/nope:v1"')
    plan = cluster.reconcile()
    assert cluster.status.phase == "Pending"
    assert "tiny-a1-0 cannot start: ImagePullBackOff: Back-off pulling image" in (
        cluster.status.message)
    assert [e.reason for e in plan.events] == ["ContainerCannotStart"]
    assert cluster.reconcile().events == []  # said once, not on every pass
    assert cluster.status.restarts.total == 0


def test_container_creating_is_not_called_stuck():
    cluster = FakeCluster(spec())
    cluster.reconcile()
    _stuck(cluster, "ContainerCreating", "")
    plan = cluster.reconcile()
    assert "cannot start" not in cluster.status.message
    assert plan.events == []
