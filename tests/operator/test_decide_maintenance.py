"""Host maintenance scheduled on a gang's node (GKE's scheduled-maintenance-time label): the gang
saves and moves before the window, as a planned migration, and the relaunch keeps off nodes
with maintenance before its horizon."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from tardigrade_contract import contract
from tardigrade_operator.decision.maintenance import (
    SCHEDULED_MAINTENANCE_LABEL,
    MaintenanceWatch,
    avoid_affinity,
    pools_due,
    scheduled_nodes,
    scheduled_start,
)
from tardigrade_operator.observation.pods import parse_pod

from tests.operator.fake_cluster import T0, FakeCluster, spec

LEAD = 1800


def training(lead: int | None = LEAD) -> FakeCluster:
    """A 2-rank gang on node-0 and node-1, at step 100 with step 80 committed."""
    preemption = {} if lead is None else {"preemption": {"maintenanceLeadSeconds": lead}}
    cluster = FakeCluster(spec(**preemption))
    cluster.reconcile()
    cluster.run_all()
    cluster.progress = contract.ProgressReport(step=100, checkpoint_step=80,
                                               checkpoint_path="gs://bucket/tiny/80")
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    return cluster


def affinity_terms(pod: dict) -> list[list[dict]]:
    required = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    return [term["matchExpressions"] for term in required["nodeSelectorTerms"]]


# ------------------------------------------------------------------------- the decision ---


@pytest.mark.parametrize(
    ("node", "starts_in", "lead", "moves"),
    [
        ("node-1", LEAD + 60, LEAD, False),  # announced, still beyond the lead time
        ("node-1", LEAD, LEAD, True),  # exactly the lead time ahead
        ("node-1", 60, LEAD, True),
        ("node-0", -30, LEAD, True),  # already due (the node has not gone yet): move now
        ("node-1", 60, 0, False),  # lead 0: never move, the maintenance hits the gang
        ("node-7", 60, LEAD, False),  # a node the gang does not run on
    ],
)
def test_gang_moves_only_for_its_own_nodes_within_the_lead_time(node, starts_in, lead, moves):
    cluster = training(lead)
    cluster.nodes_maintenance = {node: cluster.now + timedelta(seconds=starts_in)}
    cluster.reconcile()
    if moves:
        assert cluster.status.restarts.migrations == 1
        assert cluster.status.recoveries[-1].cause == "Migration"
        assert all(p["metadata"].get("deletionTimestamp") for p in cluster.attempt_pods())
    else:
        assert cluster.status.restarts.total == 0
        assert cluster.status.phase == "Running"
        assert not any(p["metadata"].get("deletionTimestamp") for p in cluster.attempt_pods())


def test_migration_is_planned_neither_failure_nor_preemption():
    cluster = training()
    cluster.nodes_maintenance = {"node-1": cluster.now + timedelta(seconds=600)}
    plan = cluster.reconcile()
    counts = cluster.status.restarts
    assert (counts.migrations, counts.preemptions, counts.failures, counts.total) == (1, 0, 0, 1)
    assert cluster.status.phase == "Restarting"
    running = next(c for c in cluster.status.conditions if c.type == "Running")
    assert running.reason == "Migration"
    assert "tiny-a1-1 on node node-1 (host maintenance scheduled in 600s" in running.message
    assert [(e.type, e.reason) for e in plan.events] == [("Normal", "Migration")]
    # SIGTERM with the pods' own grace: every rank saves the same step before it exits.
    assert sorted(plan.delete_pods) == [("tiny-a1-0", None), ("tiny-a1-1", None)]


def test_moved_gang_resumes_from_its_save_and_keeps_off_the_maintenance():
    cluster = training()
    cluster.nodes_maintenance = {"node-1": cluster.now + timedelta(seconds=600)}
    cluster.reconcile()
    recorded = cluster.status.recoveries[-1].time
    cluster.advance(3)
    cluster.terminate_all(contract.EXIT_PREEMPTED_SAVED, step=101, checkpoint=101)
    plan = cluster.reconcile()
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["tiny-a2-0", "tiny-a2-1"]
    recovery = cluster.status.recoveries[-1]
    assert (recovery.restore_step, recovery.steps_lost) == (101, 0)
    horizon = str(int((recorded + timedelta(seconds=LEAD)).timestamp()))
    for pod in plan.create_pods:
        assert affinity_terms(pod) == [
            [{"key": SCHEDULED_MAINTENANCE_LABEL, "operator": "DoesNotExist"}],
            [{"key": SCHEDULED_MAINTENANCE_LABEL, "operator": "Gt", "values": [horizon]}],
        ]
    # The new gang runs (elsewhere): training goes on, nothing more is counted.
    cluster.nodes_maintenance = {}
    cluster.run_all()
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    assert cluster.status.restarts.total == 1


def test_finishing_an_interrupted_migration_launch_renders_the_same_pods():
    cluster = training()
    cluster.nodes_maintenance = {"node-1": cluster.now + timedelta(seconds=600)}
    cluster.reconcile()
    cluster.terminate_all(contract.EXIT_PREEMPTED_SAVED, step=101, checkpoint=101)
    first = {p["metadata"]["name"]: p for p in cluster.reconcile().create_pods}
    # The operator died after creating rank 0 only: the next pass creates rank 1.
    del cluster.pods["tiny-a2-1"]
    cluster.advance(30)
    plan = cluster.reconcile()
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["tiny-a2-1"]
    assert plan.create_pods[0]["spec"]["affinity"] == first["tiny-a2-1"]["spec"]["affinity"]


def test_a_preemption_relaunch_keeps_off_maintenance_too():
    cluster = training()
    cluster.disrupt(cluster.attempt_pods()[1])
    cluster.terminate_all(contract.EXIT_PREEMPTED_SAVED, step=101, checkpoint=101)
    cluster.reconcile()
    plan = cluster.reconcile()
    assert plan.create_pods
    recorded = cluster.status.recoveries[-1].time
    horizon = str(int((recorded + timedelta(seconds=LEAD)).timestamp()))
    for pod in plan.create_pods:
        assert affinity_terms(pod)[1] == [
            {"key": SCHEDULED_MAINTENANCE_LABEL, "operator": "Gt", "values": [horizon]}]
    assert cluster.status.restarts.preemptions == 1


@pytest.mark.parametrize(("lead", "confined"), [(LEAD, True), (0, False)])
def test_the_first_gang_keeps_off_maintenance_while_a_lead_time_is_set(lead, confined):
    cluster = FakeCluster(spec(preemption={"maintenanceLeadSeconds": lead}))
    cluster.nodes_maintenance = {"node-1": cluster.now + timedelta(seconds=60)}
    plan = cluster.reconcile()
    assert len(plan.create_pods) == 2
    for pod in plan.create_pods:
        if not confined:
            assert "affinity" not in pod["spec"]
            continue
        horizon = str(int((T0 + timedelta(seconds=lead)).timestamp()))
        assert affinity_terms(pod) == [
            [{"key": SCHEDULED_MAINTENANCE_LABEL, "operator": "DoesNotExist"}],
            [{"key": SCHEDULED_MAINTENANCE_LABEL, "operator": "Gt", "values": [horizon]}],
        ]


# ------------------------------------------------------------------ TPU slices: by pool ---

TPU = {"kind": "tpu", "type": "tpu-v5-lite-podslice", "topology": "2x4", "count": 4}
# Slice pools of 2 hosts; pool-a also has a host without a rank on it (being repaired, or a
# sub-block pool larger than the slice): the slice goes with it all the same.
POOLS = {"node-0": "pool-a", "node-1": "pool-a", "node-9": "pool-a",
         "node-2": "pool-b", "node-3": "pool-b", "node-4": "pool-c", "node-5": "pool-c"}


def tpu_training() -> FakeCluster:
    """One v5e 2x4 slice (2 hosts) training on node-0 and node-1 of pool-a."""
    cluster = FakeCluster(spec(replicas=2, accelerator=TPU,
                               preemption={"maintenanceLeadSeconds": LEAD}), node_pools=POOLS)
    cluster.reconcile()  # the slice's leader
    cluster.run_all()
    cluster.reconcile()  # its follower, pinned to the leader's pool
    cluster.run_all()
    cluster.progress = contract.ProgressReport(step=100, checkpoint_step=80,
                                               checkpoint_path="gs://bucket/tiny/80")
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    return cluster


def test_a_tpu_slice_moves_when_any_node_of_its_pool_is_due():
    cluster = tpu_training()
    cluster.nodes_maintenance = {"node-9": cluster.now + timedelta(seconds=600)}
    cluster.reconcile()
    assert cluster.status.restarts.migrations == 1
    running = next(c for c in cluster.status.conditions if c.type == "Running")
    assert "node pool pool-a) goes with node node-9" in running.message


def test_a_gpu_gang_does_not_move_for_another_node_of_its_pool():
    cluster = training()
    cluster.node_pools = {"node-0": "gpu-pool", "node-1": "gpu-pool", "node-9": "gpu-pool"}
    cluster.nodes_maintenance = {"node-9": cluster.now + timedelta(seconds=600)}
    cluster.reconcile()
    assert cluster.status.restarts.total == 0


def test_every_tpu_launch_keeps_off_whole_pools_due_before_its_horizon():
    cluster = FakeCluster(spec(replicas=2, accelerator=TPU,
                               preemption={"maintenanceLeadSeconds": LEAD}), node_pools=POOLS)
    cluster.nodes_maintenance = {
        "node-9": cluster.now + timedelta(seconds=600),  # pool-a: due within the lead
        "node-4": cluster.now + timedelta(seconds=LEAD + 600),  # pool-c: after the horizon
    }
    (leader,) = cluster.reconcile().create_pods
    outside = {"key": "cloud.google.com/gke-nodepool", "operator": "NotIn", "values": ["pool-a"]}
    assert all(outside in term for term in affinity_terms(leader))
    # The follower, pinned to whichever pool the leader got, keeps the same rule.
    cluster.run_all()
    leader_pod = cluster.attempt_pods()[0]
    leader_pod["spec"]["nodeName"] = "node-2"
    (follower,) = cluster.reconcile().create_pods
    assert follower["spec"]["nodeSelector"]["cloud.google.com/gke-nodepool"] == "pool-b"
    assert affinity_terms(follower) == affinity_terms(leader)


def test_without_node_pools_a_tpu_launch_avoids_nodes_only():
    cluster = FakeCluster(spec(replicas=2, accelerator=TPU,
                               preemption={"maintenanceLeadSeconds": LEAD}))
    cluster.nodes_maintenance = {"node-9": cluster.now + timedelta(seconds=600)}
    for pod in cluster.reconcile().create_pods:
        assert all(e["key"] == SCHEDULED_MAINTENANCE_LABEL
                   for term in affinity_terms(pod) for e in term)


def test_default_lead_time_is_half_an_hour():
    cluster = training(lead=None)
    cluster.nodes_maintenance = {"node-1": cluster.now + timedelta(seconds=1799)}
    cluster.reconcile()
    assert cluster.status.restarts.migrations == 1


# ------------------------------------------------------------------ reading the label ---


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1733296000", datetime.fromtimestamp(1733296000, T0.tzinfo)),
        (" 1733296000 ", datetime.fromtimestamp(1733296000, T0.tzinfo)),
        ("", None),
        ("soon", None),
        ("-5", None),
        (None, None),
    ],
)
def test_label_value_is_epoch_seconds(value, expected):
    assert scheduled_start(value) == expected


def test_newest_node_object_of_a_name_wins():
    nodes = scheduled_nodes([("node-1", [(5, "1000"), (9, "2000")]), ("node-2", [(3, "bad")]),
                             ("node-3", [])])
    assert nodes == {"node-1": datetime.fromtimestamp(2000, T0.tzinfo)}


def test_watch_ignores_pods_being_stopped_or_unplaced():
    pod = parse_pod({"metadata": {"name": "tiny-a1-0", "labels": {
        "tardigrade.dev/job": "tiny", "tardigrade.dev/attempt": "1", "tardigrade.dev/rank": "0"},
        "deletionTimestamp": "2026-12-02T12:00:30Z"},
        "spec": {"nodeName": "node-0"}, "status": {"phase": "Running"}})
    assert pod is not None
    watch = MaintenanceWatch({"node-0": T0}, T0, timedelta(seconds=LEAD))
    assert watch.due(pod) is None


def test_affinity_admits_nodes_without_maintenance_or_with_it_later():
    terms = avoid_affinity(1733296000)["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == 2  # ORed: either term admits a node


@pytest.mark.parametrize(("starts_in", "avoided"), [
    (-60, ["pool-a"]), (0, ["pool-a"]), (LEAD, ["pool-a"]), (LEAD + 1, [])])
def test_a_pool_is_avoided_when_a_node_of_it_is_due_before_the_horizon(starts_in, avoided):
    horizon = int((T0 + timedelta(seconds=LEAD)).timestamp())
    scheduled = {"node-9": T0 + timedelta(seconds=starts_in)}
    assert pools_due(scheduled, POOLS, horizon) == avoided
    assert pools_due(scheduled, {}, horizon) == []  # a node of no known pool
