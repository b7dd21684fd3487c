"""Kueue admission of a labelled TrainingJob, decided without a server (queueing.py): held
until admitted, launched at the admitted count on the admitted flavor's nodes, stopped after
a save on eviction and resumed from that step, and the Workload writes each pass asks for."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from tardigrade_contract import contract
from tardigrade_operator.api.parse import parse_spec
from tardigrade_operator.api.types import TrainingJobStatus
from tardigrade_operator.decision import queueing
from tardigrade_operator.decision.queueing import (
    CreateWorkload,
    DeleteWorkload,
    Flavor,
    JobIdentity,
    ReleaseQuota,
    ResizeWorkload,
    SetPodsReady,
    WorkloadCondition,
    WorkloadView,
    gate_for,
)

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
# Admitted, and the job side has said the gang runs (what a running gang's Workload holds).
READY = {**ADMITTED, "PodsReady": WorkloadCondition("True", "Started", "")}
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


def test_with_kueue_not_installed_a_labelled_job_is_held_and_writes_no_workload():
    missing = gate_for("team-queue", None, {}, 2, kueue=queueing.KueueApi(workloads=False))
    cluster = FakeCluster(spec(), queue=missing)
    plan = cluster.reconcile()
    assert plan.create_pods == [] and cluster.status.phase == "Queued"
    assert cluster.status.conditions[-1].reason == "KueueNotInstalled"
    assert "install Kueue, or remove the label" in cluster.status.message
    assert queueing.workload_actions(IDENTITY, _spec(), cluster.status, missing, False, None,
                                     NOW) == []


def test_with_a_kueue_too_old_a_labelled_job_is_held_and_told_which_kueue_it_needs():
    """A Kueue before v0.15 serves kueue.x-k8s.io/v1beta1 only: named as too old, with the
    version needed, not as missing."""
    old = gate_for("team-queue", None, {}, 2,
                   kueue=queueing.KueueApi(workloads=False, other_versions=("v1beta1",)))
    cluster = FakeCluster(spec(), queue=old)
    plan = cluster.reconcile()
    assert plan.create_pods == [] and cluster.status.phase == "Queued"
    assert cluster.status.conditions[-1].reason == "KueueTooOld"
    assert "serves kueue.x-k8s.io/v1beta1" in cluster.status.message
    assert "Tardigrade needs Kueue >= v0.17" in cluster.status.message
    assert queueing.workload_actions(IDENTITY, _spec(), cluster.status, old, False, None,
                                     NOW) == []


def test_the_workload_is_created_then_released_after_eviction_once_no_pod_is_active():

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

    actions = queueing.workload_actions(IDENTITY, _spec(replicas=3),
                                        TrainingJobStatus(phase="Queued"), gate(PENDING),
                                        False, None, NOW)
    assert actions == [ResizeWorkload(queueing.workload_name(JOB.name, JOB.uid), "7", 3)]
    # Never while Kueue holds quota for it (its webhook refuses podSet changes then).
    assert queueing.workload_actions(IDENTITY, _spec(replicas=3),
                                     TrainingJobStatus(phase="Running"),
                                     gate(READY, admitted=2), True, None, NOW) == []


def test_workload_names_follow_kueues_scheme():
    name = queueing.workload_name("tiny", "uid-1")
    assert name.startswith("trainingjob-tiny-") and len(name) == len("trainingjob-tiny-") + 5


def grow_view(conditions: dict[str, WorkloadCondition], count: int = 1) -> WorkloadView:
    return WorkloadView(
        name=queueing.grow_workload_name(JOB.name, JOB.uid), owner_uid=JOB.uid,
        resource_version="9", count=count, conditions=conditions, role=queueing.GROW_ROLE)


def test_a_running_job_grown_trains_on_until_kueue_reserves_the_extra_replicas():
    """Kueue holds quota for 2 and the job asks for 3: the extra one is asked for in a grow
    Workload while the gang of 2 trains on; once Kueue reserves it, the gang stops after a
    save, both Workloads go once no pod is active, one for 3 is made, and the admitted gang
    of 3 restores the saved step."""
    cluster = FakeCluster(spec(), queue=gate(ADMITTED, admitted=2, replicas=2))
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=20)
    cluster.reconcile()
    cluster.spec["replicas"] = 3
    asked = gate(READY, admitted=2, replicas=3)
    assert asked.growing and asked.admitted and not asked.resizing
    cluster.queue = asked
    plan = cluster.reconcile()
    assert plan.delete_pods == [] and plan.create_pods == []
    assert cluster.status.phase == "Running"
    assert cluster.status.queue.growing_to == 3 and cluster.status.queue.admitted_replicas == 2
    running = TrainingJobStatus(phase="Running")
    [create] = queueing.workload_actions(IDENTITY, _spec(replicas=3), running, asked, True,
                                         None, NOW)
    assert isinstance(create, CreateWorkload)
    body = create.body
    assert body["metadata"]["name"] == queueing.grow_workload_name(JOB.name, JOB.uid)
    assert body["metadata"]["labels"][queueing.ROLE_LABEL] == queueing.GROW_ROLE
    assert body["spec"]["podSets"][0]["count"] == 1
    # Held to the flavor the gang runs on.
    template = body["spec"]["podSets"][0]["template"]["spec"]
    assert template["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    # Waiting, in Kueue's words, and the gang untouched.
    waiting = gate_for("team-queue", workload(READY, 2, 2), {"spot": SPOT}, 3,
                       grow_view(PENDING))
    cluster.queue = waiting
    plan = cluster.reconcile()
    assert plan.delete_pods == [] and cluster.status.phase == "Running"
    assert "insufficient unused quota for cpu" in cluster.status.queue.message
    assert queueing.workload_actions(IDENTITY, _spec(replicas=3), running, waiting, True,
                                     None, NOW) == []
    assert [e.reason for p in cluster.plans for e in p.events].count("GrowQueued") == 1
    # Asked for 4 instead: the waiting request takes the new count.
    assert queueing.workload_actions(
        IDENTITY, _spec(replicas=4), running,
        gate_for("team-queue", workload(READY, 2, 2), {"spot": SPOT}, 4, grow_view(PENDING)),
        True, None, NOW) == [ResizeWorkload(queueing.grow_workload_name(JOB.name, JOB.uid),
                                            "9", 2)]
    # Reserved: now the gang stops after a save.
    reserved = gate_for("team-queue", workload(READY, 2, 2), {"spot": SPOT}, 3,
                        grow_view(ADMITTED))
    assert reserved.resizing and not reserved.admitted
    cluster.queue = reserved
    plan = cluster.reconcile()
    assert sorted(n for n, _ in plan.delete_pods) == ["tiny-a1-0", "tiny-a1-1"]
    assert plan.create_pods == []
    assert (cluster.status.phase, cluster.status.conditions[-1].reason) == ("Queued", "Resizing")
    assert "reserved quota for 1 more replicas" in cluster.status.message
    # While ranks still save, both Workloads keep their quota (the gang's says it recovers);
    # once none is active, the gang's own goes, and the request only once that one is seen
    # going.
    status = TrainingJobStatus(phase="Queued")
    [recovering] = queueing.workload_actions(IDENTITY, _spec(replicas=3), status, reserved,
                                             True, None, NOW)
    assert _pods_ready(recovering) == ("False", "WaitForRecovery")
    assert queueing.workload_actions(IDENTITY, _spec(replicas=3), status, reserved, False,
                                     None, NOW) == [
        DeleteWorkload(queueing.workload_name(JOB.name, JOB.uid), "7")]
    cluster.terminate_all(SAVED, step=31, checkpoint=31)
    cluster.reconcile()
    # That delete refused (Kueue wrote meanwhile) or not yet seen: the old admission, still
    # read as admitted at 2, launches nothing while the request holds its reservation.
    plan = cluster.reconcile()
    assert plan.create_pods == [] and cluster.status.phase == "Queued"
    going = gate_for("team-queue", dataclasses.replace(workload(READY, 2, 2), deleting=True),
                     {"spot": SPOT}, 3, grow_view(ADMITTED))
    cluster.queue = going
    assert cluster.reconcile().create_pods == []
    assert queueing.workload_actions(IDENTITY, _spec(replicas=3), status, going, False,
                                     None, NOW) == [
        DeleteWorkload(queueing.grow_workload_name(JOB.name, JOB.uid), "9")]
    # The request gone before the gang's own (another client deleted it): still nothing
    # launches under a Workload on its way out.
    cluster.queue = gate_for("team-queue",
                             dataclasses.replace(workload(READY, 2, 2), deleting=True),
                             {"spot": SPOT}, 3, None)
    assert cluster.reconcile().create_pods == []
    # Gone: the next pass makes the gang's own again for 3, and no grow request.
    [create] = queueing.workload_actions(IDENTITY, _spec(replicas=3), status,
                                         gate(None, replicas=3), False, None, NOW)
    assert isinstance(create, CreateWorkload)
    assert create.body["spec"]["podSets"][0]["count"] == 3
    assert create.body["metadata"]["labels"][queueing.ROLE_LABEL] == "main"
    cluster.queue = gate(ADMITTED, admitted=3, count=3, replicas=3)
    plan = cluster.reconcile()
    assert [p["metadata"]["name"] for p in plan.create_pods] == [
        "tiny-a2-0", "tiny-a2-1", "tiny-a2-2"]
    assert cluster.status.queue.growing_to is None
    env = {e["name"]: e.get("value") for e in plan.create_pods[0]["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_RESTORE_STEP] == "31"
    assert cluster.status.restarts.total == 0 and cluster.status.restarts.failures == 0


def test_a_grow_under_a_pending_admission_check_trains_on_until_the_check_passes():
    """Quota for the extra replica reserved, its ProvisioningRequest check still Pending (the
    nodes not provisioned yet): the gang of 2 trains on and says what it waits for; once the
    check is Ready, the grow goes ahead (the gang stops after a save)."""
    cluster = FakeCluster(spec(), queue=gate(ADMITTED, admitted=2, replicas=2))
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    cluster.spec["replicas"] = 3
    reserved_only = {"QuotaReserved": ADMITTED["QuotaReserved"],
                     "Admitted": WorkloadCondition("False", "UnsatisfiedChecks", "")}
    # Kueue lists the checks on the Workload a moment after it reserved quota: not yet a grow.
    unlisted = gate_for("team-queue", workload(READY, 2, 2), {"spot": SPOT}, 3,
                        grow_view(reserved_only))
    assert unlisted.growing and not unlisted.grow_reserved and not unlisted.resizing
    provisioning = dataclasses.replace(grow_view(reserved_only), pending_checks=(
        ("dws", "Pending", "provisioning 1 node(s)"),))
    waiting = gate_for("team-queue", workload(READY, 2, 2), {"spot": SPOT}, 3, provisioning)
    assert waiting.growing and not waiting.grow_reserved and not waiting.resizing
    cluster.queue = waiting
    plan = cluster.reconcile()
    assert plan.delete_pods == [] and cluster.status.phase == "Running"
    assert ("quota reserved, admission check dws Pending: provisioning 1 node(s)"
            in cluster.status.queue.message)
    assert "the gang trains at 2 meanwhile" in cluster.status.queue.message
    provisioned = gate_for("team-queue", workload(READY, 2, 2), {"spot": SPOT}, 3,
                           grow_view(ADMITTED))
    assert provisioned.grow_reserved and provisioned.resizing
    cluster.queue = provisioned
    assert sorted(n for n, _ in cluster.reconcile().delete_pods) == ["tiny-a1-0", "tiny-a1-1"]


def test_a_grow_request_goes_when_it_is_no_longer_wanted_or_kueue_evicts_it():
    name = queueing.grow_workload_name(JOB.name, JOB.uid)
    running = TrainingJobStatus(phase="Running")
    # Scaled back to what runs: the request goes.
    back = gate_for("team-queue", workload(READY, 2, 2), {"spot": SPOT}, 2, grow_view(PENDING))
    assert not back.growing
    assert queueing.workload_actions(IDENTITY, _spec(replicas=2), running, back, True, None,
                                     NOW) == [DeleteWorkload(name, "9")]
    # Evicted by Kueue (a higher priority needs the quota): dropped, then asked for again.
    evicted = gate_for("team-queue", workload(READY, 2, 2), {"spot": SPOT}, 3, grow_view(EVICTED))
    assert evicted.growing and not evicted.grow_reserved and evicted.admitted
    assert queueing.workload_actions(IDENTITY, _spec(replicas=3), running, evicted, True, None,
                                     NOW) == [DeleteWorkload(name, "9")]
    # Reserved for another count than now asked for: dropped, then asked for again.
    other = gate_for("team-queue", workload(READY, 2, 2), {"spot": SPOT}, 4, grow_view(ADMITTED, 1))
    assert not other.resizing and other.admitted
    assert queueing.workload_actions(IDENTITY, _spec(replicas=4), running, other, True, None,
                                     NOW) == [DeleteWorkload(name, "9")]
    # The gang's own Workload evicted: no grow while it is requeued.
    gone = gate_for("team-queue", workload(EVICTED, 2, 2), {"spot": SPOT}, 3, grow_view(PENDING))
    assert not gone.growing
    assert DeleteWorkload(name, "9") in queueing.workload_actions(
        IDENTITY, _spec(replicas=3), running, gone, True, None, NOW)
    # Finished: nothing more to ask for.
    done = TrainingJobStatus(phase="Succeeded")
    asked = gate_for("team-queue", workload(READY, 2, 2), {"spot": SPOT}, 3, grow_view(PENDING))
    assert DeleteWorkload(name, "9") in queueing.workload_actions(
        IDENTITY, _spec(replicas=3), done, asked, False, None, NOW)


def test_a_running_job_shrunk_relaunches_inside_its_admission_then_hands_the_rest_back():
    """A shrink needs no new admission: the gang of 3 saves and relaunches at 2 under the same
    Workload (never requeued, so never overtaken in the queue), and only once the 2 run is
    the third replica's quota handed back (reclaimablePods); a grow asks for it again."""
    name = queueing.workload_name(JOB.name, JOB.uid)
    cluster = FakeCluster(spec(replicas=3), queue=gate(ADMITTED, admitted=3, count=3,
                                                       replicas=3))
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=20)
    cluster.reconcile()
    cluster.spec["replicas"] = 2
    shrunk = gate(READY, admitted=3, count=3, replicas=2)
    assert shrunk.admitted and not shrunk.resizing and not shrunk.growing
    assert (shrunk.runs, shrunk.reclaim) == (2, 1)
    cluster.queue = shrunk
    plan = cluster.reconcile()
    assert len(plan.delete_pods) == 3 and plan.create_pods == []
    assert cluster.status.phase == "Resizing"
    # While the gang stops and while the smaller one starts, the quota still backs it: only
    # PodsReady moves (the gang recovers), nothing is handed back.
    [recovering] = queueing.workload_actions(IDENTITY, _spec(replicas=2), cluster.status,
                                             shrunk, True, None, NOW)
    assert _pods_ready(recovering) == ("False", "WaitForRecovery")
    shrunk = gate({**ADMITTED, "PodsReady": WorkloadCondition("False", "WaitForRecovery", "")},
                  admitted=3, count=3, replicas=2)
    cluster.queue = shrunk
    cluster.terminate_all(SAVED, step=31, checkpoint=31)
    plan = cluster.reconcile()
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["tiny-a2-0", "tiny-a2-1"]
    env = {e["name"]: e.get("value") for e in plan.create_pods[0]["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_RESTORE_STEP] == "31"
    assert queueing.workload_actions(IDENTITY, _spec(replicas=2), cluster.status, shrunk,
                                     True, None, NOW) == []
    cluster.run_all()
    cluster.reconcile()
    assert (cluster.status.phase, cluster.status.replicas) == ("Running", 2)
    assert queueing.workload_actions(IDENTITY, _spec(replicas=2), cluster.status, shrunk,
                                     True, None, NOW) == [queueing.ReclaimPods(name, "7", 1)]
    # Handed back: Kueue counts 2, the job holds 2, nothing more to write.
    handed = gate_for("team-queue", dataclasses.replace(workload(READY, 3, 3), reclaimable=1),
                      {"spot": SPOT}, 2)
    assert (handed.held, handed.runs, handed.reclaim) == (2, 2, None) and handed.admitted
    cluster.queue = handed
    plan = cluster.reconcile()
    assert plan.delete_pods == [] and plan.create_pods == []
    assert cluster.status.queue.admitted_replicas == 2
    assert queueing.workload_actions(IDENTITY, _spec(replicas=2), cluster.status, handed,
                                     True, None, NOW) == []
    assert cluster.status.restarts.resizes == 1 and cluster.status.restarts.failures == 0
    # Scaled back up to 3: the replica handed back is asked for again, as any grow.
    regrow = gate_for("team-queue", dataclasses.replace(workload(ADMITTED, 3, 3), reclaimable=1),
                      {"spot": SPOT}, 3)
    assert regrow.growing and regrow.grow_extra == 1 and regrow.admitted
    # Evicted and released: requeued at what the job asks for, with nothing reclaimable
    # (Kueue wants reclaimablePods <= the podSet's count).
    requeued = gate_for("team-queue", dataclasses.replace(workload(PENDING, 3), reclaimable=1),
                        {"spot": SPOT}, 2)
    assert queueing.workload_actions(IDENTITY, _spec(replicas=2),
                                     TrainingJobStatus(phase="Queued"), requeued, False, None,
                                     NOW) == [ResizeWorkload(name, "7", 2, None, True)]


def _pods_ready(action: queueing.WorkloadAction) -> tuple[str, str]:
    assert isinstance(action, SetPodsReady)
    [condition] = [c for c in action.conditions if c["type"] == "PodsReady"]
    return condition["status"], condition["reason"]


def test_reclaimable_pods_are_read_from_the_workloads_status():
    body = queueing.build_workload(IDENTITY, _spec(replicas=3), "team-queue", 3, None)
    body["status"] = {"reclaimablePods": [{"name": "other", "count": 5},
                                          {"name": queueing.PODSET, "count": 1}]}
    assert queueing.parse_workload(body).reclaimable == 1


def test_min_replicas_lets_kueue_admit_part_of_the_gang_which_asks_for_the_rest():
    """spec.minReplicas is the podSet's minCount: Kueue admits as many as fit, down to it
    (PartialAdmission); the gang runs at the admitted count and asks for the rest on its own."""
    body = queueing.build_workload(IDENTITY, _spec(replicas=4, minReplicas=2), "team-queue", 4,
                                   None)
    assert body["spec"]["podSets"][0]["count"] == 4
    assert body["spec"]["podSets"][0]["minCount"] == 2
    without = queueing.build_workload(IDENTITY, _spec(replicas=4), "team-queue", 4, None)
    assert "minCount" not in without["spec"]["podSets"][0]
    partial = gate(ADMITTED, admitted=3, count=4, replicas=4)
    assert partial.admitted and partial.held == 3 and not partial.resizing
    assert partial.growing and partial.grow_extra == 1
    cluster = FakeCluster(spec(replicas=4, minReplicas=2), queue=partial)
    plan = cluster.reconcile()
    assert len(plan.create_pods) == 3
    assert cluster.status.queue.admitted_replicas == 3 and cluster.status.queue.growing_to == 4
    running = TrainingJobStatus(phase="Running")
    [create] = queueing.workload_actions(IDENTITY, _spec(replicas=4, minReplicas=2), running,
                                         gate(READY, admitted=3, count=4, replicas=4), True,
                                         None, NOW)
    assert isinstance(create, CreateWorkload)
    assert create.body["spec"]["podSets"][0]["count"] == 1
    # Scaled down to what runs: nothing stops.
    settled = gate(ADMITTED, admitted=3, count=4, replicas=3)
    assert settled.admitted and not settled.resizing and not settled.growing
    # Requeued (no quota): the Workload takes the new bounds.
    pending = gate(PENDING, count=4, replicas=3)
    assert queueing.workload_actions(IDENTITY, _spec(replicas=3, minReplicas=3), running,
                                     pending, False, None, NOW) == [
        ResizeWorkload(queueing.workload_name(JOB.name, JOB.uid), "7", 3, None)]


def test_multi_host_tpu_slices_are_not_admitted_in_part():
    tpu = _spec(replicas=4, minReplicas=2, accelerator={
        "kind": "tpu", "type": "tpu-v5-lite-podslice", "topology": "2x4", "count": 4})
    body = queueing.build_workload(IDENTITY, tpu, "team-queue", 4, None)
    assert "minCount" not in body["spec"]["podSets"][0]


def test_a_partial_admission_hands_nothing_back_until_the_job_asks_for_less_than_it_runs():
    """Admitted 2 of 4 asked for: the gang runs at 2 and asks for the rest; nothing is
    reclaimable (Kueue already counts 2). Scaled to 1, Kueue must count 1: 4 - 1 = 3."""
    partial = gate_for("team-queue", workload(ADMITTED, count=4, admitted=2), {"spot": SPOT}, 4)
    assert (partial.held, partial.runs, partial.reclaim) == (2, 2, None) and partial.growing
    shrunk = gate_for("team-queue", workload(ADMITTED, count=4, admitted=2), {"spot": SPOT}, 1)
    assert (shrunk.runs, shrunk.reclaim) == (1, 3) and not shrunk.growing
    handed = gate_for("team-queue", dataclasses.replace(
        workload(ADMITTED, count=4, admitted=2), reclaimable=3), {"spot": SPOT}, 1)
    assert (handed.held, handed.reclaim) == (1, None)


def _conditions(view: dict[str, WorkloadCondition]) -> list[dict[str, Any]]:
    """The Workload's stored conditions for a view's (what the index hands the writer)."""
    return [{"type": kind, "status": c.status, "reason": c.reason, "message": c.message,
             "lastTransitionTime": "2025-12-31T00:00:00Z"} for kind, c in view.items()]


def _with_pods_ready(conditions: dict[str, WorkloadCondition], action: queueing.WorkloadAction
                     ) -> dict[str, WorkloadCondition]:
    """The conditions once the writer carried `action` out."""
    status, reason = _pods_ready(action)
    return {**conditions, "PodsReady": WorkloadCondition(status, reason, "")}


def _pods_ready_writes(conditions: dict[str, WorkloadCondition], phase: str
                       ) -> list[queueing.WorkloadAction]:
    return queueing.workload_actions(
        IDENTITY, _spec(), TrainingJobStatus(phase=phase), gate(conditions, admitted=2),
        phase != "Queued", None, NOW, _conditions(conditions))


def test_pods_ready_follows_the_gang_as_kueues_job_framework_writes_it():
    """Kueue's waitForPodsReady (on by default since v0.19) evicts an admitted Workload whose
    PodsReady is not True in time: the job side says WaitForStart until every rank runs,
    Started once they do, WaitForRecovery while the gang relaunches after a disruption
    (Kueue's recoveryTimeout), Recovered once it runs again; each written once."""
    cluster = FakeCluster(spec(), queue=gate(ADMITTED, admitted=2))
    conditions = dict(ADMITTED)
    cluster.reconcile()
    assert cluster.status.phase != "Running"
    [write] = _pods_ready_writes(conditions, cluster.status.phase)
    assert _pods_ready(write) == ("False", "WaitForStart")
    conditions = _with_pods_ready(conditions, write)
    assert _pods_ready_writes(conditions, cluster.status.phase) == []  # said once
    cluster.run_all()
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    [write] = _pods_ready_writes(conditions, cluster.status.phase)
    assert _pods_ready(write) == ("True", "Started")
    conditions = _with_pods_ready(conditions, write)
    # Training for days writes nothing more: Kueue has its True.
    for _ in range(3):
        cluster.reconcile()
        assert _pods_ready_writes(conditions, cluster.status.phase) == []
    # A rank's node is reclaimed: the gang saves and relaunches under the same admission.
    cluster.disrupt(cluster.attempt_pods()[0])
    cluster.reconcile()
    assert cluster.status.phase != "Running"
    [write] = _pods_ready_writes(conditions, cluster.status.phase)
    assert _pods_ready(write) == ("False", "WaitForRecovery")
    conditions = _with_pods_ready(conditions, write)
    cluster.terminate_all(SAVED, step=12, checkpoint=12)
    cluster.reconcile()
    assert _pods_ready_writes(conditions, cluster.status.phase) == []
    cluster.run_all()
    cluster.reconcile()
    assert cluster.status.phase == "Running" and cluster.status.attempt == 2
    [write] = _pods_ready_writes(conditions, cluster.status.phase)
    assert _pods_ready(write) == ("True", "Recovered")
    conditions = _with_pods_ready(conditions, write)
    assert _pods_ready_writes(conditions, cluster.status.phase) == []


def test_pods_ready_is_decided_from_the_admission_and_what_it_said_before():
    view = workload(ADMITTED, admitted=2)
    reasons = {
        "not admitted": queueing.pods_ready(workload(PENDING), gang_running=True),
        "admitted, starting": queueing.pods_ready(view, gang_running=False),
        "admitted, running": queueing.pods_ready(view, gang_running=True),
    }
    assert {k: (c.status, c.reason) for k, c in reasons.items()} == {
        "not admitted": ("False", "WaitForStart"),
        "admitted, starting": ("False", "WaitForStart"),
        "admitted, running": ("True", "Started")}
    for before, running, after in [
            (("True", "Started"), False, ("False", "WaitForRecovery")),
            (("True", "Recovered"), False, ("False", "WaitForRecovery")),
            (("False", "WaitForRecovery"), False, ("False", "WaitForRecovery")),
            (("False", "WaitForRecovery"), True, ("True", "Recovered")),
            (("True", "Recovered"), True, ("True", "Recovered")),
            (("False", "WaitForStart"), True, ("True", "Started")),
            # Kueue before v0.16 said reason PodsReady for a start: still a start.
            (("False", "PodsReady"), False, ("False", "WaitForStart"))]:
        said = workload({**ADMITTED, "PodsReady": WorkloadCondition(*before, "")}, admitted=2)
        got = queueing.pods_ready(said, running)
        assert (got.status, got.reason) == after, (before, running)


def test_pods_ready_keeps_its_transition_time_and_the_other_conditions():
    """Kueue times a recovery from PodsReady's lastTransitionTime: a write that keeps the
    status keeps the time; Kueue's own conditions are written back as stored."""
    recovering = {**ADMITTED, "PodsReady": WorkloadCondition("False", "WaitForRecovery", "")}
    stored = _conditions(recovering)
    [write] = queueing.workload_actions(
        IDENTITY, _spec(), TrainingJobStatus(phase="Running"), gate(recovering, admitted=2),
        True, None, NOW, stored)
    assert isinstance(write, SetPodsReady)
    written = {c["type"]: c for c in write.conditions}
    assert written["PodsReady"]["lastTransitionTime"] == NOW.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert written["QuotaReserved"] == stored[0] and written["Admitted"] == stored[1]
    # Not admitted yet: said once while it waits, and not again.
    [waiting] = queueing.workload_actions(IDENTITY, _spec(), TrainingJobStatus(phase="Queued"),
                                          gate(PENDING), False, None, NOW, _conditions(PENDING))
    assert _pods_ready(waiting) == ("False", "WaitForStart")
    said = {**PENDING, "PodsReady": WorkloadCondition("False", "WaitForStart", "")}
    assert queueing.workload_actions(IDENTITY, _spec(), TrainingJobStatus(phase="Queued"),
                                     gate(said), False, None, NOW, _conditions(said)) == []


def test_a_gang_that_cannot_start_in_time_is_stopped_released_and_requeued_with_its_save():
    """Kueue evicts with PodsReadyTimeout a Workload whose gang did not start within the
    timeout: the job side stops the gang, releases the quota with Requeued=False (Kueue flips
    it once its back-off ends) and PodsReady back to WaitForStart, and the next admission
    resumes from the saved step, without touching the failure budget."""
    cluster = FakeCluster(spec(), queue=gate(ADMITTED, admitted=2))
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=20)
    cluster.reconcile()
    cluster.disrupt(cluster.attempt_pods()[0])
    cluster.reconcile()
    cluster.terminate_all(SAVED, step=31, checkpoint=31)
    cluster.reconcile()  # relaunching, and (as a node selector nothing matches) stuck there
    timed_out = {**ADMITTED,
                 "PodsReady": WorkloadCondition("False", "WaitForRecovery", ""),
                 "Evicted": WorkloadCondition("True", "PodsReadyTimeout",
                                              "Exceeded the PodsReady timeout ml/x")}
    cluster.queue = gate(timed_out, admitted=2)
    plan = cluster.reconcile()
    assert sorted(n for n, _ in plan.delete_pods) == ["tiny-a2-0", "tiny-a2-1"]
    assert (cluster.status.phase, cluster.status.conditions[-1].reason) == ("Queued", "Evicting")
    # Evicted: no PodsReady of its own while the gang stops (Kueue times out no evicted one).
    assert queueing.workload_actions(IDENTITY, _spec(), cluster.status, cluster.queue, True,
                                     None, NOW, _conditions(timed_out)) == []
    cluster.terminate_all(SAVED, step=31, checkpoint=31)
    cluster.reconcile()
    [release] = queueing.workload_actions(IDENTITY, _spec(), cluster.status, cluster.queue,
                                          False, None, NOW, _conditions(timed_out))
    assert isinstance(release, ReleaseQuota)
    values = {c["type"]: (c["status"], c["reason"]) for c in release.conditions}
    assert values["Requeued"] == ("False", "PodsReadyTimeout")
    assert values["PodsReady"] == ("False", "WaitForStart")
    assert values["QuotaReserved"] == ("False", "Pending")
    assert values["Admitted"] == ("False", "NoReservation")
    cluster.queue = gate(PENDING)
    cluster.reconcile()
    cluster.queue = gate(ADMITTED, admitted=2)
    plan = cluster.reconcile()
    env = {e["name"]: e.get("value") for e in plan.create_pods[0]["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_RESTORE_STEP] == "31"
    assert cluster.status.restarts.failures == 0


def test_a_workload_on_its_way_out_admits_no_gang():
    """After a grow's save the job deletes its Workloads; Kueue's finalizer keeps the old one,
    still Admitted, until its quota is released. Seen then, it must not relaunch the gang at
    the old count (the e2e grow test saw a relaunch at 2, then at 3)."""
    cluster = FakeCluster(spec(), queue=gate(PENDING))
    cluster.reconcile()
    going = dataclasses.replace(workload(ADMITTED, count=2, admitted=2), deleting=True)
    cluster.queue = gate_for("team-queue", going, {"spot": SPOT}, 2)
    assert not cluster.queue.admitted
    plan = cluster.reconcile()
    assert plan.create_pods == [] and cluster.status.phase == "Queued"
    cluster.queue = gate(ADMITTED, admitted=2)
    assert [p["metadata"]["name"] for p in cluster.reconcile().create_pods] == [
        "tiny-a1-0", "tiny-a1-1"]
