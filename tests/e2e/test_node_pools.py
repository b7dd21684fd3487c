"""End to end, node pools and the autoscaler with the real operator and trainers.

- The newcomer's scenario: the default local cluster (one node, its pool recreates a reclaimed
  VM), a 2-replica job, `tardigrade local preempt <its node>`. The job must come back to 2
  replicas on the recreated node, never shrink, never sit in Resizing.
- A job for an autoscaled spot pool with no nodes yet: the autoscaler's TriggeredScaleUp holds
  the operator off shrinking, though the node takes longer than the unschedulable timeout.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.gke.autoscaler import NodePool
from tardigrade_local.gke.disruptions import DEFAULT_REPLACE_AFTER_SECONDS
from tardigrade_local.gke.nodes import NodeConfig

from tests.e2e.harness import Cluster, OperatorProcess, running_operator, trainingjob, wait_for

pytestmark = pytest.mark.slow

SPOT = "cloud.google.com/gke-spot"
# Slower than the operator's unschedulable timeout (below): only the autoscaler's event can
# keep the operator from shrinking the gang meanwhile.
PROVISION_SECONDS = 50.0
UNSCHEDULABLE_TIMEOUT_SECONDS = 35
SPOT_POOL = NodePool("spot-pool", max_size=1, provision_seconds=PROVISION_SECONDS,
                     template=NodeConfig("template", labels={SPOT: "true"}, taints=(
                         {"key": SPOT, "value": "true", "effect": "NoSchedule"},)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("pools")
    # What `tardigrade local up` starts by default (one node, recreated after a reclaim),
    # plus an autoscaled spot pool that has no node yet.
    with LocalCluster(root / "cluster", nodes=1,
                      replace_after_seconds=DEFAULT_REPLACE_AFTER_SECONDS,
                      node_pools=[SPOT_POOL], autoscaler_scan_seconds=1.0) as local:
        yield Cluster(local)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    # Longer than the default pool's VM recreation (20 s), shorter than a spot-pool scale-up.
    with running_operator(cluster, tmp_path_factory.mktemp("op"),
                          env={"TARDIGRADE_UNSCHEDULABLE_TIMEOUT_SECONDS":
                               str(UNSCHEDULABLE_TIMEOUT_SECONDS)}) as process:
        yield process


def test_the_only_node_preempted_comes_back_and_the_job_recovers_at_full_size(
        cluster: Cluster, operator: OperatorProcess):
    name = "newcomer"
    cluster.apply(trainingjob(name, steps=40))  # replicas 2, minReplicas 1
    log = cluster.step_log(name)
    wait_for(lambda: (log.collect(), log.last_step >= 5)[1], 300, "training to pass step 5")
    node = cluster.pods(name)[0].spec.node_name
    cluster.local.preempt_node(node)  # the cluster's default: its pool recreates it
    phases: set[str] = set()

    def back_at_full_size() -> bool:
        log.collect()
        status = cluster.status(name)
        phases.add(status.get("phase", ""))
        return (status.get("attempt", 0) >= 2 and status.get("phase") == "Running"
                and status.get("replicas") == 2)

    wait_for(back_at_full_size, 240, "the job running again with 2 replicas")
    operator.assert_alive()
    status = cluster.status(name)
    assert status["restarts"]["preemptions"] == 1
    assert status["restarts"]["resizes"] == 0
    assert "Resizing" not in phases
    assert {p.spec.node_name for p in cluster.pods(name)
            if p.metadata.labels["tardigrade.dev/attempt"] == str(status["attempt"])} == {node}
    final = cluster.wait_phase(name, {"Succeeded"}, timeout=300, collector=log)
    assert final["step"] == 40


def test_a_scale_up_under_way_holds_off_the_shrink(cluster: Cluster, operator: OperatorProcess):
    name = "burst"
    cluster.apply(trainingjob(name, steps=20, spot={"enabled": True}))  # minReplicas 1
    reasons: set[str] = set()

    def running() -> bool:
        status = cluster.status(name)
        running_condition = next((c for c in status.get("conditions", [])
                                  if c["type"] == "Running"), {})
        reasons.add(running_condition.get("reason", ""))
        return status.get("phase") == "Running"

    wait_for(running, PROVISION_SECONDS + 120, "the gang running on the new spot node")
    operator.assert_alive()
    status = cluster.status(name)
    assert (status["replicas"], status["attempt"], status["restarts"]["resizes"]) == (2, 1, 0)
    assert "WaitingForScaleUp" in reasons
    nodes = {p.spec.node_name for p in cluster.pods(name)}
    assert len(nodes) == 1 and next(iter(nodes)).startswith("spot-pool-")
    events = cluster.core.list_namespaced_event(
        "default", field_selector="involvedObject.kind=Pod,reason=TriggeredScaleUp").items
    assert any("spot-pool 0->1 (max: 1)" in e.message for e in events)
    cluster.wait_phase(name, {"Succeeded"}, timeout=300)
