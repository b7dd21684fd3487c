"""A job deleted and re-created under the same name: children are matched by owner uid."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

from tardigrade_operator.observation.pods import parse_pod, parse_service
from tardigrade_operator.rendering.manifests import JobRef

from tests.operator.fake_cluster import JOB, FakeCluster, iso, spec

NEW_JOB = JobRef(name=JOB.name, namespace=JOB.namespace, uid="uid-2")


def _condition(cluster: FakeCluster, kind: str) -> Any:
    return next(c for c in cluster.status.conditions if c.type == kind)


def previous_job_running() -> FakeCluster:
    """The first incarnation of `tiny`, training at attempt 2 (after one preemption)."""
    old = FakeCluster(spec())
    old.reconcile()
    old.run_all()
    old.reconcile()
    old.disrupt(old.attempt_pods()[0])
    old.reconcile()
    for pod in old.attempt_pods():
        old.terminate(pod, 143)
    old.reconcile()
    old.run_all()
    old.reconcile()
    assert (old.status.phase, old.status.attempt) == ("Running", 2)
    return old


def recreated(old: FakeCluster, service: dict[str, Any] | None) -> FakeCluster:
    """The new job of the same name sees the old one's pods (and maybe its Service)."""
    return FakeCluster(spec(), job=NEW_JOB, pods=copy.deepcopy(old.pods), service=service)


def being_deleted(cluster: FakeCluster, grace: int = 30) -> None:
    """What the garbage collector does to the old job's pods: a graceful delete (the old
    job's finalizer was released when it went away)."""
    for pod in cluster.pods.values():
        pod["metadata"]["deletionTimestamp"] = iso(cluster.now + timedelta(seconds=grace))
        pod["metadata"]["finalizers"] = []


def test_a_recreated_job_waits_for_the_previous_jobs_running_pods_and_never_touches_them():
    new = recreated(previous_job_running(), service=None)
    being_deleted(new)
    plan = new.reconcile()
    assert plan.create_pods == [] and plan.delete_pods == [] and plan.release_pods == []
    assert new.status.phase == "Pending"
    assert new.status.attempt == 0 and new.status.restarts.total == 0
    ready = _condition(new, "Ready")
    assert ready.reason == "WaitingForPreviousJob"
    assert "tiny-a2-0" in ready.message and "previous TrainingJob" in ready.message
    assert _condition(new, "Reconciling").status == "True"


def test_a_recreated_job_launches_past_the_previous_attempts_once_they_stopped():
    new = recreated(previous_job_running(), service=None)
    being_deleted(new)
    new.reconcile()
    new.advance(31)  # past the old pods' deletion deadline: SIGKILLed by then
    plan = new.reconcile()
    # Pod names carry the attempt: a3 cannot collide with the old a1/a2 pods still listed.
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["tiny-a3-0", "tiny-a3-1"]
    assert all(p["metadata"]["ownerReferences"][0]["uid"] == "uid-2" for p in plan.create_pods)
    assert plan.create_service["metadata"]["ownerReferences"][0]["uid"] == "uid-2"
    assert new.status.attempt == 3 and new.status.recoveries == []
    assert new.status.restarts.total == 0
    assert plan.delete_pods == []  # the old pods are the garbage collector's


def test_the_previous_jobs_finished_pods_are_not_adopted_or_read():
    old = previous_job_running()
    old.terminate_all(0, step=500, checkpoint=500)  # the old run had finished
    new = recreated(old, service=None)
    plan = new.reconcile()
    assert new.status.phase == "Pending" and new.status.step is None
    assert new.status.last_checkpoint is None
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["tiny-a3-0", "tiny-a3-1"]
    new.run_all()
    new.reconcile()
    assert new.status.phase == "Running" and new.status.attempt == 3


def test_pods_of_the_previous_job_do_not_disrupt_the_new_gang():
    old = previous_job_running()
    new = recreated(old, service=None)
    for pod in new.pods.values():
        new.terminate(pod, 0)
    new.reconcile()
    new.run_all()
    new.reconcile()
    assert new.status.phase == "Running"
    # An old pod that now fails (its node lost) is no rank of the new gang.
    old_pod = new.pods["tiny-a2-0"]
    old_pod["status"]["phase"] = "Failed"
    new.disrupt(old_pod)
    plan = new.reconcile()
    assert new.status.phase == "Running" and new.status.restarts.preemptions == 0
    assert plan.delete_pods == []


def test_a_service_of_the_previous_job_is_waited_for_then_replaced():
    old = previous_job_running()
    new = recreated(old, service=copy.deepcopy(old.service))
    for pod in new.pods.values():
        new.terminate(pod, 143)
    plan = new.reconcile()
    assert plan.create_pods == [] and plan.create_service is None
    ready = _condition(new, "Ready")
    assert ready.reason == "WaitingForPreviousJob" and "Service ml/tiny" in ready.message
    new.service = None  # the garbage collector deleted it
    plan = new.reconcile()
    assert plan.create_service["metadata"]["ownerReferences"][0]["uid"] == "uid-2"
    assert len(plan.create_pods) == 2


def test_a_service_of_the_previous_job_that_stays_is_reported_as_taken():
    old = previous_job_running()
    new = recreated(old, service=copy.deepcopy(old.service))
    for pod in new.pods.values():
        new.terminate(pod, 143)
    new.reconcile()
    new.advance(new.settings.previous_service_wait.total_seconds())
    plan = new.reconcile()
    assert plan.create_pods == []
    assert new.status.phase == "Failed"
    failed = _condition(new, "Failed")
    assert failed.reason == "ServiceNameTaken"
    assert "uid-1" in failed.message and "kubectl delete service -n ml tiny" in failed.message


def test_a_users_service_with_the_jobs_name_fails_the_job_with_the_fix():
    users = {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "tiny", "namespace": "ml"},
             "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}}
    cluster = FakeCluster(spec(), service=users)
    plan = cluster.reconcile()
    assert plan.create_pods == [] and plan.create_service is None
    assert cluster.status.phase == "Failed"
    assert _condition(cluster, "Stalled").status == "True"
    message = _condition(cluster, "Failed").message
    assert "Service ml/tiny" in message and "no owner" in message
    assert "rename the job" in message and "kubectl delete service -n ml tiny" in message
    assert any(e.reason == "ServiceNameTaken" and e.type == "Warning" for e in plan.events)


def test_a_users_service_taking_the_name_mid_run_stops_the_gang():
    cluster = FakeCluster(spec())
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    cluster.service = {"metadata": {"name": "tiny", "namespace": "ml", "ownerReferences": [
        {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": "d-1"}]}}
    plan = cluster.reconcile()
    assert cluster.status.phase == "Failed"
    assert sorted(name for name, _ in plan.delete_pods) == ["tiny-a1-0", "tiny-a1-1"]
    assert "Deployment web (uid d-1)" in _condition(cluster, "Failed").message


def test_the_jobs_own_service_is_left_alone():
    cluster = FakeCluster(spec())
    cluster.reconcile()
    plan = cluster.reconcile()
    assert plan.create_service is None and cluster.status.phase == "Pending"
    assert _condition(cluster, "Ready").reason != "WaitingForPreviousJob"


def test_owner_uid_is_read_from_the_trainingjob_owner_reference():
    cluster = FakeCluster(spec())
    plan = cluster.reconcile()
    pod = plan.create_pods[0]
    assert parse_pod(pod).owner_uid == "uid-1"
    pod["metadata"]["ownerReferences"] = [
        {"apiVersion": "batch/v1", "kind": "Job", "name": "tiny", "uid": "j-1"}]
    assert parse_pod(pod).owner_uid is None
    assert parse_service(plan.create_service).owner_uid == "uid-1"
    assert parse_service({"metadata": {"name": "tiny"}}).owner == "no owner"
