"""Changes an owner makes to a TrainingJob Kueue holds, decided without a server
(queueing.py): spec.suspend deactivates its Workload (Kueue evicts it, the job side releases
the quota) and resuming reactivates it; the queue label moved, removed or its priority label
changed follow into the Workload; and whatever changes what the pods ask for is resized
through Kueue, never run outside the admission."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from tardigrade_contract import contract
from tardigrade_operator.api.parse import parse_spec
from tardigrade_operator.api.types import QueueStatus, TrainingJobStatus
from tardigrade_operator.decision import queue_name_rule, queueing
from tardigrade_operator.decision.queueing import (
    CreateWorkload,
    DeleteWorkload,
    Flavor,
    JobIdentity,
    PatchWorkloadSpec,
    ReleaseQuota,
    WorkloadCondition,
    WorkloadView,
    gate_for,
)

from tests.operator.fake_cluster import JOB, FakeCluster, spec

SAVED = contract.EXIT_PREEMPTED_SAVED
NOW = datetime(2026, 1, 1, tzinfo=UTC)
IDENTITY = JobIdentity(JOB.name, JOB.namespace, JOB.uid)
NAME = queueing.workload_name(JOB.name, JOB.uid)
SPOT = Flavor({"cloud.google.com/gke-spot": "true"}, [])
FLAVORS = {"spot": SPOT}
PENDING = {"QuotaReserved": WorkloadCondition("False", "Pending", "insufficient quota")}
ADMITTED = {"QuotaReserved": WorkloadCondition("True", "QuotaReserved", ""),
            "Admitted": WorkloadCondition("True", "Admitted", ""),
            "PodsReady": WorkloadCondition("True", "Started", "")}
DEACTIVATED = {**ADMITTED, "Evicted": WorkloadCondition(
    "True", "Deactivated", "The workload is deactivated")}


def view(conditions: dict[str, WorkloadCondition], body: dict[str, Any], *,
         admitted: int | None = None, queue: str = "team-queue", active: bool = True,
         **extra: Any) -> WorkloadView:
    """The Workload the operator made for `body` (the job's spec), as Kueue left it."""
    return WorkloadView(
        name=NAME, owner_uid=JOB.uid, resource_version="7", count=body["replicas"],
        conditions=conditions, admitted_count=admitted,
        admitted_flavors={"cpu": "spot"} if admitted else {},
        cluster_queue="team" if admitted else None, queue_name=queue, active=active,
        podset_hash=queueing.podset_hash(parse_spec(body)), **extra)


def gate(body: dict[str, Any], workload: WorkloadView | None, queue: str = "team-queue",
         gang_active: bool = False, flavors: dict[str, Flavor] | None = None,
         priority_class: str | None = None) -> queueing.QueueGate:
    return gate_for(queue, workload, FLAVORS if flavors is None else flavors,
                    body["replicas"], spec=parse_spec(body), gang_active=gang_active,
                    priority_class=priority_class)


def actions(body: dict[str, Any], phase: str, the_gate: queueing.QueueGate,
            gang_active: bool, priority: tuple[str, int] | None = None
            ) -> list[queueing.WorkloadAction]:
    return queueing.workload_actions(IDENTITY, parse_spec(body), TrainingJobStatus(phase=phase),
                                     the_gate, gang_active, priority, NOW)


def running(body: dict[str, Any]) -> FakeCluster:
    cluster = FakeCluster(body, queue=gate(body, view(ADMITTED, body, admitted=2)))
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=20)
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    return cluster


# ------------------------------------------------------------------------- spec.suspend ---


def test_suspend_deactivates_the_workload_releases_its_quota_and_resume_requeues_it():
    """As Kueue's own: a suspended job's Workload gets spec.active false, Kueue evicts it
    (reason Deactivated), the job side stops the gang after a save and releases the quota
    (Requeued=False, Deactivated: Kueue turns it True once reactivated); spec.suspend false
    reactivates it, and admitted again the gang resumes from the saved step."""
    body = spec()
    cluster = running(body)
    cluster.spec["suspend"] = True
    suspended = dict(cluster.spec)
    cluster.queue = gate(suspended, view(ADMITTED, suspended, admitted=2), gang_active=True)
    plan = cluster.reconcile()
    assert sorted(n for n, _ in plan.delete_pods) == ["tiny-a1-0", "tiny-a1-1"]
    assert cluster.status.phase == "Suspended"
    assert "suspended (spec.suspend)" in cluster.status.queue.message
    assert actions(suspended, "Suspended", cluster.queue, True) == [
        PatchWorkloadSpec(NAME, "7", {"active": False}, {queueing.SUSPENDED_ANNOTATION: "true"})]
    # Kueue evicts it; no quota goes back while a rank still saves.
    ours = {"active": False, "suspended_by_job": True}
    evicted = gate(suspended, view(DEACTIVATED, suspended, admitted=2, **ours),
                   gang_active=True)
    cluster.queue = evicted
    plan = cluster.reconcile()
    assert not any(e.reason == "Evicted" for e in plan.events)  # the user's own doing
    assert actions(suspended, "Suspended", evicted, True) == []
    cluster.terminate_all(SAVED, step=31, checkpoint=31)
    stopped = gate(suspended, view(DEACTIVATED, suspended, admitted=2, **ours))
    cluster.queue = stopped
    cluster.reconcile()
    assert cluster.status.phase == "Suspended"
    [release] = actions(suspended, "Suspended", stopped, False)
    assert isinstance(release, ReleaseQuota)
    values = {c["type"]: (c["status"], c["reason"]) for c in release.conditions}
    assert values["QuotaReserved"] == ("False", "Pending")
    assert values["Requeued"] == ("False", "Deactivated")
    # Released and deactivated: nothing more while suspended, nothing launches.
    released = {"QuotaReserved": WorkloadCondition("False", "Pending", ""),
                "Evicted": DEACTIVATED["Evicted"],
                "Requeued": WorkloadCondition("False", "Deactivated", "")}
    idle = gate(suspended, view(released, suspended, active=False, suspended_by_job=True))
    cluster.queue = idle
    assert cluster.reconcile().create_pods == []
    assert actions(suspended, "Suspended", idle, False) == []
    # Resumed: reactivated, queued again (phase Queued, not Evicted), then admitted.
    cluster.spec["suspend"] = False
    resumed = gate(body, view(released, body, active=False, suspended_by_job=True))
    cluster.queue = resumed
    plan = cluster.reconcile()
    assert plan.create_pods == [] and cluster.status.phase == "Queued"
    assert cluster.status.conditions[-1].reason == "Queued"
    assert actions(body, "Queued", resumed, False) == [
        PatchWorkloadSpec(NAME, "7", {"active": True}, {queueing.SUSPENDED_ANNOTATION: None})]
    cluster.queue = gate(body, view(ADMITTED, body, admitted=2))
    plan = cluster.reconcile()
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["tiny-a2-0", "tiny-a2-1"]
    assert cluster.status.recoveries[-1].cause == "Resume"
    env = {e["name"]: e.get("value") for e in plan.create_pods[0]["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_RESTORE_STEP] == "31"
    assert cluster.status.restarts.total == 0


def test_a_job_suspended_from_the_start_queues_nothing_until_resumed():
    body = spec(suspend=True)
    [create] = actions(body, "Suspended", gate(body, None), False)
    assert isinstance(create, CreateWorkload)
    assert create.body["spec"]["active"] is False
    assert create.body["metadata"]["annotations"][queueing.SUSPENDED_ANNOTATION] == "true"
    assert queueing.parse_workload(create.body).suspended_by_job
    assert "active" not in queueing.build_workload(IDENTITY, parse_spec(spec()), "q", 2,
                                                   None)["spec"]
    # Queued, then suspended: deactivated, so Kueue never admits it meanwhile.
    pending = spec()
    queued = gate(body, view(PENDING, pending))
    assert actions(body, "Queued", queued, False) == [
        PatchWorkloadSpec(NAME, "7", {"active": False}, {queueing.SUSPENDED_ANNOTATION: "true"})]


def test_a_deactivation_not_the_jobs_own_is_left_to_whoever_made_it():
    """Kueue deactivates a Workload itself (requeuing limit, maximum execution time, a
    rejected admission check: Evicted reason DeactivatedDueTo...), and an admin stops one by
    hand with spec.active false: the job is not suspended, yet the operator does not undo
    it; the job waits and says why and how to go on."""
    body = spec()
    for reason in ("DeactivatedDueToRequeuingLimitExceeded", "Deactivated"):
        stopped = {**ADMITTED, "Evicted": WorkloadCondition("True", reason, "exceeded")}
        cluster = running(body)
        cluster.queue = gate(body, view(stopped, body, admitted=2, active=False),
                             gang_active=True)
        plan = cluster.reconcile()
        assert len(plan.delete_pods) == 2
        cluster.terminate_all(SAVED, step=31, checkpoint=31)
        released = {"QuotaReserved": WorkloadCondition("False", "Pending", ""),
                    "Evicted": stopped["Evicted"]}
        cluster.queue = gate(body, view(released, body, active=False))
        assert cluster.reconcile().create_pods == []
        assert cluster.status.phase == "Queued"
        assert cluster.status.conditions[-1].reason == "Deactivated"
        assert "not by this job's spec.suspend" in cluster.status.message
        assert not any(isinstance(a, PatchWorkloadSpec)
                       for a in actions(body, "Queued", cluster.queue, False))


# ------------------------------------------------------------------------------ labels ---


def test_the_queue_label_moved_while_queued_moves_the_workload():
    body = spec()
    pending = gate(body, view(PENDING, body, queue="old-queue"), queue="new-queue")
    assert pending.mismatch == "queue" and not pending.resizing
    assert actions(body, "Queued", pending, False) == [
        PatchWorkloadSpec(NAME, "7", {"queueName": "new-queue"})]


def test_the_queue_label_moved_while_admitted_stops_the_gang_then_queues_in_the_new_queue():
    body = spec()
    cluster = running(body)
    moved = gate(body, view(ADMITTED, body, admitted=2, queue="team-queue"),
                 queue="other-queue", gang_active=True)
    assert moved.resizing and not moved.admitted
    cluster.queue = moved
    plan = cluster.reconcile()
    assert sorted(n for n, _ in plan.delete_pods) == ["tiny-a1-0", "tiny-a1-1"]
    assert cluster.status.phase == "Queued"
    assert cluster.status.conditions[-1].reason == "QueueChanged"
    assert "moved from LocalQueue team-queue to other-queue" in cluster.status.message
    # Quota backs the gang while it saves; once stopped, the Workload goes.
    assert [type(a).__name__ for a in actions(body, "Queued", moved, True)] != [
        "DeleteWorkload"]
    cluster.terminate_all(SAVED, step=31, checkpoint=31)
    stopped = gate(body, view(ADMITTED, body, admitted=2, queue="team-queue"),
                   queue="other-queue")
    cluster.queue = stopped
    assert cluster.reconcile().create_pods == []
    assert actions(body, "Queued", stopped, False) == [DeleteWorkload(NAME, "7")]
    [create] = actions(body, "Queued", gate(body, None, queue="other-queue"), False)
    assert isinstance(create, CreateWorkload)
    assert create.body["spec"]["queueName"] == "other-queue"
    cluster.queue = gate(body, view(ADMITTED, body, admitted=2, queue="other-queue"),
                         queue="other-queue")
    plan = cluster.reconcile()
    assert len(plan.create_pods) == 2 and cluster.status.recoveries[-1].cause == "Resume"


def test_the_priority_label_reaches_the_workload_where_kueue_allows_it():
    body = spec()
    high, low = ("high", 1000), ("low", 10)
    # Another WorkloadPriorityClass: followed, admitted or not (Kueue allows the name and
    # value of a WorkloadPriorityClass ref to change while quota is held).
    admitted = gate(body, view(ADMITTED, body, admitted=2, priority=low), gang_active=True,
                    priority_class="high")
    assert actions(body, "Running", admitted, True, high) == [PatchWorkloadSpec(NAME, "7", {
        "priorityClassRef": {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                             "name": "high"}, "priority": 1000})]
    # Already so: nothing.
    same = gate(body, view(ADMITTED, body, admitted=2, priority=high), priority_class="high")
    assert actions(body, "Running", same, True) == []
    # Added or removed: only while no quota is held (Kueue refuses it otherwise).
    none = gate(body, view(ADMITTED, body, admitted=2), priority_class="high")
    assert actions(body, "Running", none, True, high) == []
    queued = gate(body, view(PENDING, body), priority_class="high")
    assert actions(body, "Queued", queued, False, high) == [PatchWorkloadSpec(NAME, "7", {
        "priorityClassRef": {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                             "name": "high"}, "priority": 1000})]
    dropped = gate(body, view(PENDING, body, priority=high))
    assert actions(body, "Queued", dropped, False) == [PatchWorkloadSpec(NAME, "7", {
        "priorityClassRef": None, "priority": None})]
    held = gate(body, view(ADMITTED, body, admitted=2, priority=high))
    assert actions(body, "Running", held, True) == []
    # A class that does not exist (no value found) is left alone.
    assert not any(isinstance(a, PatchWorkloadSpec) for a in actions(
        body, "Queued", gate(body, view(PENDING, body), priority_class="nope"), False, None))


def test_the_queue_label_removed_takes_the_job_out_of_kueue():
    body = spec()
    stray = view(ADMITTED, body, admitted=2)
    going = dataclasses.replace(stray, name="other", deleting=True)
    # No rule: the Workloads go at once, and the gang runs on as an unlabelled job.
    assert queueing.stray_workload_actions([stray, going], gang_active=True, held=False) == [
        DeleteWorkload(NAME, "7")]
    # Held by the admin's rule: they go once the gang stopped.
    assert queueing.stray_workload_actions([stray], gang_active=True, held=True) == []
    assert queueing.stray_workload_actions([stray], gang_active=False, held=True) == [
        DeleteWorkload(NAME, "7")]
    # The status says no queue any more.
    cluster = running(body)
    assert cluster.status.queue is not None
    cluster.queue = None
    plan = cluster.reconcile()
    assert cluster.status.queue is None and plan.delete_pods == []
    assert cluster.status.phase == "Running"


def test_the_rule_holds_a_job_that_ran_under_kueue_and_lost_its_label():
    """A gang launched before the admin's rule is left to run; one that ran under Kueue, or
    that the rule already holds, is held: removing the label is no way around the quota."""
    outside = TrainingJobStatus(phase="Running", attempt=1)
    under = TrainingJobStatus(phase="Running", attempt=1,
                              queue=QueueStatus(local_queue="team-queue", admitted=True))
    held = TrainingJobStatus(phase="Queued", attempt=1)
    assert queue_name_rule.launched_outside_kueue(outside)
    assert not queue_name_rule.launched_outside_kueue(under)
    assert not queue_name_rule.launched_outside_kueue(held)
    assert not queue_name_rule.launched_outside_kueue(TrainingJobStatus(phase="Pending"))
    # Held, the running gang stops after a save and nothing relaunches.
    cluster = running(spec())
    cluster.queue = queueing.queue_name_hold(JOB.namespace)
    plan = cluster.reconcile()
    assert len(plan.delete_pods) == 2 and cluster.status.phase == "Queued"
    cluster.terminate_all(SAVED, step=31, checkpoint=31)
    for _ in range(2):
        assert cluster.reconcile().create_pods == []
    assert cluster.status.conditions[-1].reason == queue_name_rule.REASON
    assert not queue_name_rule.launched_outside_kueue(cluster.status)


# ------------------------------------------------------------------- admission outputs ---


def admitted_body(**status: Any) -> dict[str, Any]:
    """A Workload as Kueue leaves it admitted, with `status` fields added."""
    body = queueing.build_workload(IDENTITY, parse_spec(spec()), "team-queue", 2, None)
    body["metadata"]["resourceVersion"] = "7"
    body["status"] = {
        "conditions": [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved"},
                       {"type": "Admitted", "status": "True", "reason": "Admitted"}],
        "admission": {"clusterQueue": "team", "podSetAssignments": [
            {"name": "trainers", "count": 2, "flavors": {"cpu": "spot"}}]}, **status}
    return body


PROVISIONED = {"admissionChecks": [
    {"name": "dws", "state": "Ready", "podSetUpdates": [
        {"name": "trainers",
         "annotations": {"autoscaling.x-k8s.io/consume-provisioning-request": "pr-1"},
         "labels": {"example.com/provisioned": "yes"},
         "nodeSelector": {"cloud.google.com/gke-nodepool": "dws-pool"},
         "tolerations": [{"key": "dws", "operator": "Exists", "effect": "NoSchedule"}]},
        {"name": "another-podset", "labels": {"not": "ours"}}]},
    {"name": "other", "state": "Ready", "podSetUpdates": [
        {"name": "trainers", "labels": {"example.com/second": "check"}}]}]}


def test_the_workload_is_read_with_what_admission_and_the_job_side_wrote():
    view = queueing.parse_workload(admitted_body(**PROVISIONED))
    assert view.queue_name == "team-queue" and view.active
    assert view.podset_hash == queueing.podset_hash(parse_spec(spec()))
    assert view.updates.labels == {"example.com/provisioned": "yes",
                                   "example.com/second": "check"}
    assert view.updates.node_selector == {"cloud.google.com/gke-nodepool": "dws-pool"}
    assert not view.topology_assigned and view.updates.conflicts == ()
    # Two checks disagreeing on a key: named.
    clash = admitted_body(admissionChecks=[
        {"name": "a", "podSetUpdates": [{"name": "trainers", "nodeSelector": {"pool": "a"}}]},
        {"name": "b", "podSetUpdates": [{"name": "trainers", "nodeSelector": {"pool": "b"}}]}])
    assert queueing.parse_workload(clash).updates.conflicts == ("nodeSelector pool: 'a' vs 'b'",)
    body = admitted_body()
    body["spec"]["active"] = False
    body["status"]["admission"]["podSetAssignments"][0]["topologyAssignment"] = {
        "levels": ["kubernetes.io/hostname"], "slices": []}
    view = queueing.parse_workload(body)
    assert not view.active and view.topology_assigned


def test_admission_checks_pod_set_updates_reach_every_pod():
    """A ProvisioningRequest check (GKE's DWS) answers with podSetUpdates the pods must carry
    (jobframework merges them after the flavors'): labels, annotations, node selector and
    tolerations, on every rank."""
    view = queueing.parse_workload(admitted_body(**PROVISIONED))
    cluster = FakeCluster(spec(), queue=gate_for("team-queue", view, FLAVORS, 2,
                                                 spec=parse_spec(spec())))
    plan = cluster.reconcile()
    assert len(plan.create_pods) == 2
    for pod in plan.create_pods:
        meta, pod_spec = pod["metadata"], pod["spec"]
        assert meta["labels"]["example.com/provisioned"] == "yes"
        assert meta["labels"]["example.com/second"] == "check"
        assert "not" not in meta["labels"]
        assert meta["annotations"]["autoscaling.x-k8s.io/consume-provisioning-request"] == "pr-1"
        assert pod_spec["nodeSelector"]["cloud.google.com/gke-nodepool"] == "dws-pool"
        assert pod_spec["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
        assert {"key": "dws", "operator": "Exists", "effect": "NoSchedule"} in pod_spec[
            "tolerations"]


def test_quota_reserved_but_an_admission_check_pending_waits_with_the_checks_words():
    """A ProvisioningRequest check Pending (GKE still provisioning): Kueue holds Admitted
    False, no pod is made, and the job says which check it waits for, in Kueue's words."""
    body = admitted_body(admissionChecks=[
        {"name": "dws", "state": "Pending", "message": "provisioning 2 node(s)"},
        {"name": "other", "state": "Ready"}])
    body["status"]["conditions"] = [
        {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved",
         "message": "Quota reserved in ClusterQueue team"},
        {"type": "Admitted", "status": "False", "reason": "UnsatisfiedChecks",
         "message": "The workload has not all admission checks Ready"}]
    view = queueing.parse_workload(body)
    assert view.pending_checks == (("dws", "Pending", "provisioning 2 node(s)"),)
    the_gate = gate_for("team-queue", view, FLAVORS, 2, spec=parse_spec(spec()))
    assert not the_gate.admitted
    assert the_gate.waiting_message() == ("waiting in LocalQueue team-queue: quota reserved, "
                                          "admission check dws Pending: provisioning 2 node(s)")
    cluster = FakeCluster(spec(), queue=the_gate)
    assert cluster.reconcile().create_pods == []
    assert cluster.status.phase == "Queued"


def held(view: WorkloadView, flavors: dict[str, Flavor], body: dict[str, Any] | None = None
         ) -> FakeCluster:
    body = body or spec()
    cluster = FakeCluster(body, queue=gate_for("team-queue", view, flavors, 2,
                                               spec=parse_spec(body)))
    for _ in range(2):
        assert cluster.reconcile().create_pods == []
    assert cluster.status.phase == "Queued"
    return cluster


def test_an_admission_the_operator_cannot_honour_holds_the_launch_and_says_why():
    plain = queueing.parse_workload(admitted_body())
    # The admitted flavor is not in the operator's index.
    cluster = held(plain, {})
    assert cluster.status.conditions[-1].reason == "FlavorNotFound"
    assert "ResourceFlavor spot" in cluster.status.message
    # A topologyAssignment that places none of the gang's pods (Topology Aware Scheduling).
    body = admitted_body()
    body["status"]["admission"]["podSetAssignments"][0]["topologyAssignment"] = {
        "levels": ["kubernetes.io/hostname"], "slices": []}
    cluster = held(queueing.parse_workload(body), FLAVORS)
    assert cluster.status.conditions[-1].reason == "TopologyNotSupported"
    assert "topologyAssignment" in cluster.status.message
    # podSetUpdates that contradict the flavor's node labels or the job's own template.
    clash = admitted_body(admissionChecks=[{"name": "a", "podSetUpdates": [
        {"name": "trainers", "nodeSelector": {"cloud.google.com/gke-spot": "false"},
         "labels": {"team": "b"}}]}])
    mine = spec(podTemplate={"labels": {"team": "a"}})
    cluster = held(queueing.parse_workload(clash), FLAVORS, mine)
    assert cluster.status.conditions[-1].reason == "PodSetUpdateConflict"
    assert "nodeSelector cloud.google.com/gke-spot: 'true' vs 'false'" in cluster.status.message
    assert "labels team: 'a' vs 'b'" in cluster.status.message
    # Once the flavor can be read, the gang launches with its labels.
    cluster = held(plain, {})
    cluster.queue = gate_for("team-queue", plain, FLAVORS, 2, spec=parse_spec(spec()))
    plan = cluster.reconcile()
    assert len(plan.create_pods) == 2
    assert plan.create_pods[0]["spec"]["nodeSelector"]["cloud.google.com/gke-spot"] == "true"


def test_a_running_gang_is_not_stopped_for_what_only_a_launch_needs():
    body = spec()
    cluster = running(body)
    unreadable = gate(body, view(ADMITTED, body, admitted=2), flavors={}, gang_active=True)
    assert unreadable.hold is None and unreadable.admitted
    cluster.queue = unreadable
    plan = cluster.reconcile()
    assert plan.delete_pods == [] and cluster.status.phase == "Running"
    # Stopped for another reason (a spot reclaim), it is held before relaunching.
    cluster.disrupt(cluster.attempt_pods()[0])
    cluster.reconcile()
    cluster.terminate_all(SAVED, step=31, checkpoint=31)
    cluster.queue = gate(body, view(ADMITTED, body, admitted=2), flavors={})
    assert cluster.reconcile().create_pods == []
    assert cluster.status.conditions[-1].reason == "FlavorNotFound"


def test_a_reactivated_workload_waits_in_kueues_words_not_as_evicted():
    """After a resume Kueue keeps Evicted=True (Deactivated) until it admits the Workload
    again: the job waits as any queued one, with Kueue's reason."""
    body = spec()
    waiting = {"QuotaReserved": WorkloadCondition("False", "Pending", "insufficient quota"),
               "Evicted": WorkloadCondition("True", "Deactivated", "deactivated"),
               "Requeued": WorkloadCondition("True", "Reactivated", "")}
    the_gate = gate(body, view(waiting, body))
    assert not the_gate.evicted and the_gate.reason() == "Queued"
    assert the_gate.waiting_message() == "waiting in LocalQueue team-queue: insufficient quota"
    ours = gate(body, view(DEACTIVATED, body, admitted=2, active=False, suspended_by_job=True))
    assert not ours.evicted
    kueues = {**ADMITTED, "Evicted": WorkloadCondition(
        "True", "DeactivatedDueToRequeuingLimitExceeded", "")}
    assert gate(body, view(kueues, body, admitted=2, active=False)).evicted
