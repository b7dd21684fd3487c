"""Node pools and the cluster autoscaler's decision, pure: which pool grows for unschedulable
pods and what each pod is told. On real nodes: a reclaimed spot VM recreated under its name and
a scale-up for a pending gang (tests/e2e/test_node_pools.py), NotTriggerScaleUp on a pod
(tests/local/test_gke_on_real_nodes.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from tardigrade_local.cluster import ClusterConfig
from tardigrade_local.gke.autoscaler import (
    MAX_SIZE_REACHED,
    NOT_TRIGGER_SCALE_UP,
    TRIGGERED_SCALE_UP,
    NodePool,
    is_unschedulable,
    plan_scale_up,
)
from tardigrade_local.gke.nodes import DEFAULT_POOL, NODE_POOL_LABEL, NodeConfig, node_labels

# Nodes of 2 cpus (the rest of the default capacity).
SMALL = NodeConfig.from_dict({"name": "template", "capacity": {"cpu": "2"}})


def pending_pod(name: str, cpu: str = "1", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "main", "resources": {"requests": {"cpu": cpu}}}],
                 **spec},
        "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]},
    }


def verdicts(plan: Any) -> dict[str, tuple[str, str]]:
    return {v.pod["metadata"]["name"]: (v.reason, v.message) for v in plan.verdicts}


# --------------------------------------------------------------------- pure: the decision ---


def test_a_pod_that_fits_a_new_node_grows_the_pool_and_is_told_so():
    pool = NodePool("pool-a", max_size=3, template=SMALL)
    plan = plan_scale_up([pending_pod("p")], [pool], sizes={"pool-a": 1}, upcoming=[])
    assert plan.grow == {"pool-a": 1}
    assert verdicts(plan) == {
        "p": (TRIGGERED_SCALE_UP, "pod triggered scale-up: [{pool-a 1->2 (max: 3)}]")}


def test_pods_are_packed_onto_new_and_upcoming_nodes():
    pool = NodePool("pool-a", max_size=5, template=SMALL)
    pods = [pending_pod(f"p{i}") for i in range(3)]  # 1 cpu each, 2 per node
    plan = plan_scale_up(pods, [pool], sizes={"pool-a": 0}, upcoming=[])
    assert plan.grow == {"pool-a": 2}
    assert {r for r, _ in verdicts(plan).values()} == {TRIGGERED_SCALE_UP}
    # Next scan: the two nodes are on their way and take all three; nothing more happens.
    coming = [pool.node_config("pool-a-1"), pool.node_config("pool-a-2")]
    again = plan_scale_up(pods, [pool], sizes={"pool-a": 0}, upcoming=coming)
    assert (again.grow, again.verdicts) == ({}, [])


def test_a_vm_its_instance_group_recreates_is_upcoming_even_in_a_pool_not_autoscaled():
    autoscaled = NodePool("burst", max_size=3, template=SMALL)
    recreated = dataclasses.replace(SMALL, name="spot-1", pool=DEFAULT_POOL)
    plan = plan_scale_up([pending_pod("p")], [autoscaled], sizes={"burst": 0},
                         upcoming=[recreated])
    assert (plan.grow, plan.verdicts) == ({}, [])


@pytest.mark.parametrize(("cpu", "sizes", "message"), [
    ("1", {"pool-a": 2}, f"1 {MAX_SIZE_REACHED}"),
    ("4", {"pool-a": 0}, "1 Insufficient cpu"),
])
def test_a_pod_no_pool_can_take_is_told_why(cpu, sizes, message):
    pool = NodePool("pool-a", max_size=2, template=SMALL)
    plan = plan_scale_up([pending_pod("p", cpu)], [pool], sizes=sizes, upcoming=[])
    assert plan.grow == {}
    assert verdicts(plan) == {
        "p": (NOT_TRIGGER_SCALE_UP, f"pod didn't trigger scale-up: {message}")}


def test_the_pool_whose_nodes_match_the_selector_grows():
    pools = [NodePool("a-cpu", 4, SMALL),
             NodePool("b-gpu", 4, NodeConfig("t", labels={"gpu": "yes"}, capacity=SMALL.capacity))]
    plan = plan_scale_up([pending_pod("p", nodeSelector={"gpu": "yes"})], pools,
                         sizes={}, upcoming=[])
    assert plan.grow == {"b-gpu": 1}
    no_match = plan_scale_up([pending_pod("q", nodeSelector={"tpu": "yes"})], pools,
                             sizes={}, upcoming=[])
    assert verdicts(no_match)["q"] == (
        NOT_TRIGGER_SCALE_UP,
        "pod didn't trigger scale-up: 2 node(s) didn't match Pod's node affinity/selector")


def test_only_unschedulable_pods_count():
    assert is_unschedulable(pending_pod("p"))
    bound = pending_pod("b")
    bound["spec"]["nodeName"] = "n"
    assert not is_unschedulable(bound)
    assert not is_unschedulable({**pending_pod("f"), "status": {"phase": "Pending"}})


def test_nodes_carry_their_pool_and_the_config_round_trips():
    node = NodeConfig("n", pool="spot-pool")
    assert node_labels(node)[NODE_POOL_LABEL] == "spot-pool"
    assert node_labels(NodeConfig("m"))[NODE_POOL_LABEL] == DEFAULT_POOL
    assert NodeConfig.from_dict(node.to_dict()) == node
    with pytest.raises(ValueError, match="max_size must be >= 0"):
        NodePool("bad", max_size=-1)
    config = ClusterConfig(state_dir=Path("x"), replace_after_seconds=3,
                           node_pools=[NodePool("pool-a", 2, SMALL, 5)])
    again = ClusterConfig.from_json(config.to_json())
    assert (again.node_pools, again.replace_after_seconds) == (config.node_pools, 3)
