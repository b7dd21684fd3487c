"""End to end on real nodes, node pools and the autoscaler with the chart's operator and real
trainers in the trainer-cpu image.

- The newcomer's scenario: the trainers' only node (a spot VM of the default pool) is
  reclaimed and its pool recreates it under its name (`RealNodeCluster.reclaim` with
  `replace_after_seconds`, as `tardigrade local preempt` has it on the default cluster). The
  job must come back to 2 replicas on the recreated node, never shrink, never sit in
  Resizing.
- A job for an autoscaled spot pool with no nodes yet: the cluster autoscaler
  (`RealNodeCluster(pools=...)`) starts a real node for it; its TriggeredScaleUp holds the
  operator off shrinking, though the node takes longer than the unschedulable timeout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from tardigrade_local.gke.autoscaler import NodePool
from tardigrade_local.gke.nodes import NODE_POOL_LABEL, NodeConfig

from tests.e2e.harness import (
    NAMESPACE,
    NEEDS_REAL_NODES,
    InstalledOperator,
    RealCluster,
    real_cluster,
    wait_for,
)
from tests.local.kube_helpers import Kube, PodRecorder

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_NODES,
]

SPOT = "cloud.google.com/gke-spot"
# The default pool's instance group recreates the reclaimed VM this long after; a real node
# then takes tens of seconds to boot on a loaded machine.
REPLACE_AFTER_SECONDS = 1.0
# Longer than that recreation (the first scenario must not shrink), shorter than a spot-pool
# scale-up (below).
UNSCHEDULABLE_TIMEOUT_SECONDS = 100
# Slower than the operator's unschedulable timeout: only the autoscaler's event can keep the
# operator from shrinking the gang meanwhile.
PROVISION_SECONDS = 120.0
# A real node's allocatable, well within this 2-core machine (nodeshape.py): two trainers fit.
POOL_NODE_CAPACITY = {"cpu": "1", "memory": "4Gi", "pods": "110"}
SPOT_POOL = NodePool("spot-pool", max_size=1, provision_seconds=PROVISION_SECONDS,
                     template=NodeConfig("template", labels={SPOT: "true"}, taints=(
                         {"key": SPOT, "value": "true", "effect": "NoSchedule"},),
                         capacity=POOL_NODE_CAPACITY))
# A node's boot, the trainer image's pull onto its fresh disk, JAX's start.
NODE_AND_TRAINERS_SECONDS = 300.0

# Added to the chart's install (tests/e2e/conftest.py's `operator`).
OPERATOR_HELM_VALUES = (
    "--set", f"operator.unschedulableTimeoutSeconds={UNSCHEDULABLE_TIMEOUT_SECONDS}",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    # The operator's on-demand node and one spot node of the default pool (the trainers'),
    # plus an autoscaled spot pool that has no node yet.
    with real_cluster(tmp_path_factory.mktemp("np"), 1, pools=[SPOT_POOL],
                      autoscaler_scan_seconds=1.0) as running:
        yield running


def test_the_only_node_preempted_comes_back_and_the_job_recovers_at_full_size(
        cluster: RealCluster, operator: InstalledOperator):
    name = "newcomer"
    cluster.apply(cluster.trainingjob(name, steps=40))  # replicas 2, minReplicas 1
    log = cluster.step_log(name)
    wait_for(lambda: (log.collect(), log.last_step >= 5)[1], 300, "training to pass step 5")
    node = cluster.spot_node_of(cluster.pods(name)[0])
    phases: set[str] = set()
    with PodRecorder(Kube(str(cluster.real.kubeconfig)), NAMESPACE,
                     f"tardigrade.dev/job={name}") as pods:
        # GKE's spot reclaim; the default pool recreates the VM under its name.
        cluster.real.reclaim(node, replace_after_seconds=REPLACE_AFTER_SECONDS)

        def back_at_full_size() -> dict[str, Any] | None:
            # The relaunched gang may also have finished its few steps by the time this looks:
            # what counts is the attempt and its size, read from the status, not the phase.
            log.collect()
            status = cluster.status(name)
            phases.add(status.get("phase", ""))
            relaunched = (status.get("attempt", 0) >= 2 and status.get("replicas") == 2
                          and status.get("phase") in ("Running", "Succeeded"))
            return status if relaunched else None

        status = wait_for(back_at_full_size, NODE_AND_TRAINERS_SECONDS,
                          "the job running again with 2 replicas")
    operator.assert_alive()
    assert status["restarts"]["preemptions"] == 1
    assert status["restarts"]["resizes"] == 0
    assert "Resizing" not in phases
    # Never shrunk: its one recovery relaunched both ranks.
    assert [(r["cause"], r["fromReplicas"], r["toReplicas"]) for r in status["recoveries"]] \
        == [("Preemption", 2, 2)], status["recoveries"]
    # Both ranks of the new attempt ran on the recreated node (as the pod watch saw them).
    placed = {state[-1]["spec"].get("nodeName") for state in pods.seen.values()
              if state[-1]["metadata"]["labels"]["tardigrade.dev/attempt"]
              == str(status["attempt"])}
    assert placed == {node}, pods.seen.keys()
    final = cluster.wait_phase(name, {"Succeeded"}, timeout=300, collector=log)
    assert final["step"] == 40


def test_a_scale_up_under_way_holds_off_the_shrink(cluster: RealCluster,
                                                   operator: InstalledOperator):
    name = "burst"
    job = cluster.trainingjob(name, steps=20, spot={"enabled": True})  # minReplicas 1
    # The spot pool's nodes only: the default pool's spot node would take the gang at once.
    job["spec"]["podTemplate"]["nodeSelector"][NODE_POOL_LABEL] = SPOT_POOL.name
    cluster.apply(job)
    reasons: set[str] = set()

    def running() -> bool:
        status = cluster.status(name)
        running_condition = next((c for c in status.get("conditions", [])
                                  if c["type"] == "Running"), {})
        reasons.add(running_condition.get("reason", ""))
        return status.get("phase") == "Running"

    wait_for(running, PROVISION_SECONDS + NODE_AND_TRAINERS_SECONDS,
             "the gang running on the new spot node")
    operator.assert_alive()
    status = cluster.status(name)
    assert (status["replicas"], status["attempt"], status["restarts"]["resizes"]) == (2, 1, 0)
    assert "WaitingForScaleUp" in reasons
    nodes = {p.spec.node_name for p in cluster.pods(name)}
    assert len(nodes) == 1 and next(iter(nodes)).startswith("spot-pool-")
    events = cluster.core.list_namespaced_event(
        "default", field_selector="involvedObject.kind=Pod,reason=TriggeredScaleUp").items
    assert any("spot-pool 0->1 (max: 1)" in e.message for e in events)
    # The node is the pool's: its labels, taint and allocatable (nodeshape.py).
    new_node = cluster.core.read_node(next(iter(nodes)))
    assert new_node.metadata.labels[NODE_POOL_LABEL] == SPOT_POOL.name
    assert new_node.metadata.labels[SPOT] == "true"
    assert [(t.key, t.effect) for t in new_node.spec.taints or []] == [(SPOT, "NoSchedule")]
    assert new_node.status.allocatable["cpu"] == POOL_NODE_CAPACITY["cpu"]
    cluster.wait_phase(name, {"Succeeded"}, timeout=300)
