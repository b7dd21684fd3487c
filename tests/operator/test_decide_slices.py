"""Resizing a TPU job by whole slices: a slice that cannot be placed goes as a whole, within
minReplicas, and the bounds themselves must be whole slices."""

from __future__ import annotations

import pytest
from tardigrade_operator.api.parse import InvalidTrainingJob, parse_spec

from tests.operator.fake_cluster import FakeCluster, iso, spec
from tests.operator.test_decide_capacity import SETTINGS, condition, started

# 2x4 topology, 4 chips a host: 2 hosts a slice.
TPU = {"kind": "tpu", "type": "tpu-v5-lite-podslice", "topology": "2x4", "count": 4}


@pytest.mark.parametrize(("placed", "relaunch"), [
    (3, 2),  # one host of the second slice placed: that slice cannot form, it goes whole
    (2, 2),  # the second slice's pool is gone: one slice left
])
def test_a_slice_that_cannot_be_placed_goes_whole(placed, relaunch):
    cluster, _ = started(4, placed=placed, minReplicas=2, accelerator=TPU)
    assert cluster.status.slices == 2
    first_attempt = cluster.status.attempt
    cluster.advance(60)
    cluster.reconcile()
    assert cluster.status.phase == "Resizing"
    assert cluster.status.recoveries[-1].to_replicas == relaunch
    assert condition(cluster, "CapacityLimited") == ("True", "Unschedulable")
    for pod in cluster.attempt_pods():  # the old gang stops
        pod["status"]["phase"] = "Failed"
    cluster.reconcile()
    cluster.reconcile()
    assert cluster.status.attempt > first_attempt
    assert len(cluster.attempt_pods()) == relaunch
    # What `kubectl get` shows next to the hosts (status.replicas): the slices they make.
    assert (cluster.status.replicas, cluster.status.slices) == (relaunch, relaunch // 2)


def test_gpu_gangs_still_shrink_host_by_host():
    cluster, _ = started(4, placed=3, minReplicas=1)
    cluster.advance(60)
    cluster.reconcile()
    assert cluster.status.recoveries[-1].to_replicas == 3
    assert cluster.status.slices is None


@pytest.mark.parametrize(("field", "value"), [("minReplicas", 1), ("maxReplicas", 5)])
def test_bounds_of_a_tpu_job_are_whole_slices(field, value):
    body = spec(replicas=4, accelerator=TPU, **{field: value})
    with pytest.raises(InvalidTrainingJob) as err:
        parse_spec(body)
    assert f"spec.{field}" in str(err.value)
    assert f"set spec.{field} to a multiple of that" in str(err.value)


# ------------------------------------------------------------- leaders first, then followers ---

# Two v5e 2x4 pools of 2 hosts each, as the operator's node watch sees them.
POOLS = {"pool-a-0": "pool-a", "pool-a-1": "pool-a", "pool-b-0": "pool-b", "pool-b-1": "pool-b"}


def _created(plan) -> dict[int, dict]:
    return {int(p["metadata"]["labels"]["tardigrade.dev/rank"]): p for p in plan.create_pods}


def _bind(cluster, rank: int, node: str) -> None:
    pod = cluster.attempt_pods()[[int(p["metadata"]["labels"]["tardigrade.dev/rank"])
                                  for p in cluster.attempt_pods()].index(rank)]
    pod["spec"]["nodeName"] = node
    pod["status"] = {"phase": "Running", "containerStatuses": [
        {"name": "trainer", "state": {"running": {}}}]}


def _pod_terms(pod: dict) -> set[str]:
    return set(pod["spec"].get("affinity") or {}) & {"podAffinity", "podAntiAffinity"}


def test_a_slice_leader_goes_first_and_its_followers_follow_it_to_its_pool():
    cluster = FakeCluster(spec(replicas=4, accelerator=TPU), settings=SETTINGS,
                          node_pools=POOLS)
    first = _created(cluster.reconcile())
    # Worker 0 of each slice, with the exclusive terms; no follower yet.
    assert sorted(first) == [0, 2]
    assert all(_pod_terms(p) == {"podAffinity", "podAntiAffinity"} for p in first.values())
    assert _created(cluster.reconcile()) == {}
    assert cluster.status.phase == "Pending" and cluster.status.restarts.total == 0

    _bind(cluster, 0, "pool-b-1")
    followers = _created(cluster.reconcile())
    assert sorted(followers) == [1]
    assert followers[1]["spec"]["nodeSelector"]["cloud.google.com/gke-nodepool"] == "pool-b"
    assert _pod_terms(followers[1]) == set()
    # Still the TPU node selectors and the slice label the leader's anti-affinity counts.
    assert followers[1]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x4"
    assert followers[1]["metadata"]["labels"]["tardigrade.dev/slice"] == "tiny-a1-s0"

    _bind(cluster, 2, "pool-a-0")
    followers = _created(cluster.reconcile())
    assert sorted(followers) == [3]
    assert followers[3]["spec"]["nodeSelector"]["cloud.google.com/gke-nodepool"] == "pool-a"
    _bind(cluster, 1, "pool-b-0")
    _bind(cluster, 3, "pool-a-1")
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    assert cluster.status.recoveries == []


def _place_the_first_slice_but_not_the_second_leader(cluster) -> None:
    """Slice 0 (ranks 0, 1) bound in pool-a; slice 1's leader (rank 2) unschedulable."""
    cluster.reconcile()
    _bind(cluster, 0, "pool-a-0")
    cluster.reconcile()  # creates follower 1
    _bind(cluster, 1, "pool-a-1")
    leader = next(p for p in cluster.attempt_pods()
                  if p["metadata"]["labels"]["tardigrade.dev/rank"] == "2")
    leader["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes are available: 4 node(s) didn't match pod affinity rules.",
         "lastTransitionTime": iso(cluster.now)}]}


def test_a_leader_that_cannot_be_placed_takes_its_slice_out_of_the_gang():
    cluster = FakeCluster(spec(replicas=4, minReplicas=2, accelerator=TPU), settings=SETTINGS,
                          node_pools=POOLS)
    _place_the_first_slice_but_not_the_second_leader(cluster)
    cluster.reconcile()
    assert cluster.status.phase == "Pending"  # slice 1 waits for its leader
    cluster.advance(60)
    cluster.reconcile()
    assert cluster.status.phase == "Resizing"
    assert cluster.status.recoveries[-1].to_replicas == 2


def test_without_node_pools_every_host_carries_the_terms():
    cluster = FakeCluster(spec(replicas=4, accelerator=TPU), settings=SETTINGS)
    created = _created(cluster.reconcile())
    assert sorted(created) == [0, 1, 2, 3]
    assert all(_pod_terms(p) == {"podAffinity", "podAntiAffinity"} for p in created.values())


def test_a_job_at_its_minimum_says_it_waits_for_capacity_while_a_leader_cannot_be_placed():
    cluster = FakeCluster(spec(replicas=4, minReplicas=4, accelerator=TPU), settings=SETTINGS,
                          node_pools=POOLS)
    _place_the_first_slice_but_not_the_second_leader(cluster)
    cluster.advance(60)
    for _ in range(3):  # the follower of slice 1 is still to come, never lost
        cluster.reconcile()
    assert condition(cluster, "CapacityLimited") == ("True", "WaitingForCapacity")
    assert "tiny-a1-2" in cluster.status.message
    assert sorted(int(p["metadata"]["labels"]["tardigrade.dev/rank"])
                  for p in cluster.attempt_pods()) == [0, 1, 2]
    assert (cluster.status.attempt, cluster.status.recoveries) == (1, [])
