"""Kueue admission of a labelled TrainingJob, decided without a server (queueing.py): held
until admitted, launched at the admitted count on the admitted flavor's nodes, stopped after
a save on eviction and resumed from that step, and the Workload writes each pass asks for."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from tardigrade_operator import queueing
from tardigrade_operator.api.parse import parse_spec
from tardigrade_operator.queueing import (
    CreateWorkload,
    DeleteWorkload,
    Flavor,
    JobIdentity,
    ReleaseQuota,
    ResizeWorkload,
    WorkloadCondition,
    WorkloadView,
    gate_for,
)
from tardigrade_trainer import contract

from tests.operator.fake_cluster import JOB, FakeCluster, spec

SAVED = contract.EXIT_PREEMPTED_SAVED
NOW = datetime(2026, 1, 1, tzinfo=UTC)
IDENTITY = JobIdentity(JOB.name, JOB.namespace, JOB.uid)
SPOT = Flavor({"cloud.google.com/gke-spot": "true"},
              [{"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
                "effect": "NoSchedule"}])
PENDING = {"QuotaReserved": WorkloadCondition(
    "False", "Pending", "couldn't assign flavors to pod set trainers: insufficient unused "
    "quota for cpu in flavor spot, 2 more needed")}
ADMITTED = {"QuotaReserved": WorkloadCondition("True", "QuotaReserved", ""),
            "Admitted": WorkloadCondition("True", "Admitted", "")}
EVICTED = {**ADMITTED, "Evicted": WorkloadCondition(
    "True", "Preempted", "Preempted to accommodate a workload (UID: x) due to prioritization")}


def workload(conditions: dict[str, WorkloadCondition], count: int = 2,
             admitted: int | None = None) -> WorkloadView:
    return WorkloadView(
        name=queueing.workload_name(JOB.name, JOB.uid), owner_uid=JOB.uid,
        resource_version="7", count=count, conditions=conditions,
        admitted_count=admitted, admitted_flavors={"cpu": "spot"} if admitted else {},
        cluster_queue="team" if admitted else None)


def gate(conditions: dict[str, WorkloadCondition] | None, admitted: int | None = None,
         count: int = 2, replicas: int | None = None) -> queueing.QueueGate:
    view = None if conditions is None else workload(conditions, count, admitted)
    return gate_for("team-queue", view, {"spot": SPOT}, replicas)


def test_a_queued_job_launches_nothing_and_says_why_in_kueues_words():
    cluster = FakeCluster(spec(), queue=gate(None))
    plan = cluster.reconcile()
    assert plan.create_pods == []
    assert cluster.status.phase == "Queued"
    assert cluster.status.queue.local_queue == "team-queue"
    cluster.queue = gate(PENDING)
    plan = cluster.reconcile()
    assert plan.create_pods == [] and cluster.status.phase == "Queued"
    assert "insufficient unused quota for cpu" in cluster.status.message
    assert cluster.status.queue.message == cluster.status.message
    suspended = next(c for c in cluster.status.conditions if c.type == "Suspended")
    assert suspended.status == "True"
    assert [e.reason for p in cluster.plans for e in p.events].count("Queued") == 1


def test_an_admitted_job_runs_at_the_admitted_count_on_the_flavors_nodes():
    cluster = FakeCluster(spec(), queue=gate(PENDING))
    cluster.reconcile()
    cluster.queue = gate(ADMITTED, admitted=2)
    plan = cluster.reconcile()
    assert len(plan.create_pods) == 2
    pod = plan.create_pods[0]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    assert SPOT.tolerations[0] in pod["tolerations"]
    assert plan.create_pods[0]["metadata"]["labels"][queueing.PODSET_LABEL] == "trainers"
    assert cluster.status.queue.admitted and cluster.status.queue.cluster_queue == "team"
    assert any(e.reason == "Admitted" for e in plan.events)
    assert cluster.status.restarts.total == 0


def test_eviction_saves_stops_requeues_and_resumes_from_the_saved_step():
    cluster = FakeCluster(spec(), queue=gate(ADMITTED, admitted=2))
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=20)
    cluster.reconcile()
    cluster.queue = gate(EVICTED, admitted=2)
    plan = cluster.reconcile()
    # Every rank gets SIGTERM at once, the gang saves one step inside its grace.
    assert sorted(n for n, _ in plan.delete_pods) == ["tiny-a1-0", "tiny-a1-1"]
    assert (cluster.status.phase, cluster.status.conditions[-1].reason) == ("Queued", "Evicting")
    assert any(e.reason == "Evicted" for e in plan.events)
    assert not any(e.reason == "Suspending" for e in plan.events)
    cluster.terminate_all(SAVED, step=31, checkpoint=31)
    plan = cluster.reconcile()
    assert plan.create_pods == [] and cluster.status.phase == "Queued"
    # Requeued by the job side (below), Kueue admits it again later.
    cluster.queue = gate(PENDING)
    cluster.reconcile()
    cluster.queue = gate(ADMITTED, admitted=2)
    plan = cluster.reconcile()
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["tiny-a2-0", "tiny-a2-1"]
    env = {e["name"]: e.get("value") for e in plan.create_pods[0]["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_RESTORE_STEP] == "31"
    assert cluster.status.recoveries[-1].cause == "Resume"
    assert cluster.status.restarts.total == 0  # never the failure budget


def test_without_the_label_nothing_changes():
    plain, labelled = FakeCluster(spec()), FakeCluster(spec(), queue=gate(ADMITTED, admitted=2))
    assert plain.reconcile().create_pods[0]["spec"].get("nodeSelector") is None
    assert plain.status.queue is None
    assert labelled.reconcile().create_pods


def _spec(**overrides: Any) -> Any:
    return parse_spec(spec(**overrides))


def test_the_workload_is_created_then_released_after_eviction_once_no_pod_is_active():
    from tardigrade_operator.api.types import TrainingJobStatus

    status = TrainingJobStatus(phase="Queued")
    actions = queueing.workload_actions(IDENTITY, _spec(), status, gate(None), False,
                                        ("high", 1000), NOW)
    assert len(actions) == 1 and isinstance(actions[0], CreateWorkload)
    body = actions[0].body
    assert body["metadata"]["ownerReferences"][0]["uid"] == JOB.uid
    assert body["metadata"]["labels"][queueing.JOB_UID_LABEL] == JOB.uid
    assert body["spec"]["queueName"] == "team-queue"
    assert body["spec"]["podSets"][0]["count"] == 2
    assert body["spec"]["priority"] == 1000
    # Evicted while ranks still save: nothing yet; once none is active, one release.
    assert queueing.workload_actions(IDENTITY, _spec(), status, gate(EVICTED, 2), True,
                                     None, NOW) == []
    stored = [{"type": "Evicted", "status": "True", "reason": "Preempted", "message": "m",
               "lastTransitionTime": "2026-01-01T00:00:00Z"},
              {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "",
               "lastTransitionTime": "2026-01-01T00:00:00Z"}]
    [release] = queueing.workload_actions(IDENTITY, _spec(), status, gate(EVICTED, 2), False,
                                          None, NOW, stored)
    assert isinstance(release, ReleaseQuota)
    values = {c["type"]: (c["status"], c["reason"]) for c in release.conditions}
    assert values["QuotaReserved"] == ("False", "Pending")
    assert values["Admitted"] == ("False", "NoReservation")
    assert values["Requeued"] == ("True", "Requeued")
    assert values["Evicted"] == ("True", "Preempted")  # Kueue's own, kept


def test_a_queued_job_resized_asks_kueue_for_the_new_count():
    from tardigrade_operator.api.types import TrainingJobStatus

    actions = queueing.workload_actions(IDENTITY, _spec(replicas=3),
                                        TrainingJobStatus(phase="Queued"), gate(PENDING),
                                        False, None, NOW)
    assert actions == [ResizeWorkload(queueing.workload_name(JOB.name, JOB.uid), "7", 3)]
    # Never while Kueue holds quota for it (its webhook refuses podSet changes then).
    assert queueing.workload_actions(IDENTITY, _spec(replicas=3),
                                     TrainingJobStatus(phase="Running"),
                                     gate(ADMITTED, admitted=2), True, None, NOW) == []


def test_workload_names_follow_kueues_scheme():
    name = queueing.workload_name("tiny", "uid-1")
    assert name.startswith("trainingjob-tiny-") and len(name) == len("trainingjob-tiny-") + 5


def test_a_running_job_resized_stops_after_a_save_and_is_requeued_at_the_new_count():
    """Kueue holds quota for 2: the gang stops after a save, the Workload is deleted once no
    pod is active and made again for 3, and the admitted gang of 3 restores the saved step."""
    cluster = FakeCluster(spec(), queue=gate(ADMITTED, admitted=2, replicas=2))
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=20)
    cluster.reconcile()
    cluster.spec["replicas"] = 3
    resized = gate(ADMITTED, admitted=2, replicas=3)
    assert resized.resizing and not resized.admitted
    cluster.queue = resized
    plan = cluster.reconcile()
    assert sorted(n for n, _ in plan.delete_pods) == ["tiny-a1-0", "tiny-a1-1"]
    assert plan.create_pods == []
    assert (cluster.status.phase, cluster.status.conditions[-1].reason) == ("Queued", "Resizing")
    assert "resized from 2 to 3 replicas" in cluster.status.message
    # While ranks still save, the Workload keeps its quota; once none is active, it goes.
    from tardigrade_operator.api.types import TrainingJobStatus
    status = TrainingJobStatus(phase="Queued")
    assert queueing.workload_actions(IDENTITY, _spec(replicas=3), status, resized, True,
                                     None, NOW) == []
    assert queueing.workload_actions(IDENTITY, _spec(replicas=3), status, resized, False,
                                     None, NOW) == [
        DeleteWorkload(queueing.workload_name(JOB.name, JOB.uid), "7")]
    cluster.terminate_all(SAVED, step=31, checkpoint=31)
    cluster.reconcile()
    # Gone: the next pass makes it again for 3.
    [create] = queueing.workload_actions(IDENTITY, _spec(replicas=3), status,
                                         gate(None, replicas=3), False, None, NOW)
    assert isinstance(create, CreateWorkload)
    assert create.body["spec"]["podSets"][0]["count"] == 3
    cluster.queue = gate(ADMITTED, admitted=3, count=3, replicas=3)
    plan = cluster.reconcile()
    assert [p["metadata"]["name"] for p in plan.create_pods] == [
        "tiny-a2-0", "tiny-a2-1", "tiny-a2-2"]
    env = {e["name"]: e.get("value") for e in plan.create_pods[0]["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_RESTORE_STEP] == "31"
    assert cluster.status.restarts.total == 0 and cluster.status.restarts.failures == 0
