"""End to end: GKE schedules host maintenance on a node of a training gang (the node label
with the start time, then the node's termination). The gang saves and moves off that node
before the window: a planned migration, no step lost. Real operator, real JAX trainers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.disruptions import SCHEDULED_MAINTENANCE_LABEL

from tests.e2e.harness import Cluster, OperatorProcess, trainingjob, wait_for

pytestmark = pytest.mark.slow

# Inside the job's default lead time (spec.preemption.maintenanceLeadSeconds, 30 min), and
# long enough for a save and a relaunch on a busy 2-core machine.
MAINTENANCE_IN = 75.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("maintenance")
    with LocalCluster(root / "cluster", nodes=3) as local:
        yield Cluster(local)


def test_gang_moves_off_a_node_before_its_host_maintenance(
        cluster: Cluster, operator: OperatorProcess):
    name = "e2e-maint"
    job = trainingjob(name, steps=1_000_000)  # trains for as long as the test looks
    job["spec"]["checkpoint"]["interval"] = {"steps": 1000}
    cluster.apply(job)
    log = cluster.step_log(name)
    cluster.wait_phase(name, {"Running"}, timeout=300, collector=log)
    wait_for(lambda: (log.collect(), log.last_step >= 5)[1], 120, "training past step 5",
             interval=0.5)
    victim = next(p for p in cluster.pods(name) if p.metadata.labels["tardigrade.dev/rank"] == "1")
    node = victim.spec.node_name
    start = cluster.local.schedule_maintenance(node, MAINTENANCE_IN)
    assert cluster.core.read_node(node).metadata.labels[SCHEDULED_MAINTENANCE_LABEL] == \
        str(int(start))

    def moved() -> tuple[dict, list] | None:
        # The migration's own attempt: on a loaded machine an unrelated restart may come first.
        log.collect()
        status = cluster.status(name)
        recovery = next((r for r in status.get("recoveries") or []
                         if r["cause"] == "Migration"), None)
        if recovery is None:
            return None
        attempt = recovery["attempt"]
        gang = [p for p in cluster.pods(name) if p.metadata.labels["tardigrade.dev/attempt"]
                == str(attempt) and p.status.phase == "Running" and p.spec.node_name]
        trained = any(r.get("event") == "step" and r["attempt"] == attempt for r in log.records)
        return (recovery, gang) if len(gang) == 2 and trained else None

    recovery, gang = wait_for(moved, MAINTENANCE_IN, "the gang training on other nodes",
                              interval=0.5)
    assert time.time() < start, "the gang moved only after the maintenance began"
    status = cluster.status(name)
    assert node not in {p.spec.node_name for p in gang}, (status["recoveries"], [
        (p.metadata.name, p.spec.node_name, p.spec.affinity) for p in gang])
    assert node in recovery["reason"], recovery
    assert status["restarts"]["migrations"] == 1
    # Every rank saved the step it stopped at and the new gang resumed from it: the gang it
    # replaced computed no step past that one.
    assert recovery["stepsLost"] == 0, recovery
    assert recovery["restoreStep"] in log.restored
    # The old gang's last lines may have gone with its pods before `log` read them.
    before = [r["step"] for r in cluster.complete_log(name).records
              if r.get("event") == "step" and r["attempt"] == recovery["attempt"] - 1]
    assert before and max(before) == recovery["restoreStep"], (max(before), recovery)
    reasons = [e.reason for e in cluster.core.list_namespaced_event(
        "default", field_selector=f"involvedObject.name={name}").items]
    assert "Migration" in reasons, reasons

    # The maintenance then takes the node down; the gang is elsewhere and trains on.
    wait_for(lambda: node not in {n.metadata.name for n in cluster.core.list_node().items},
             MAINTENANCE_IN + 60, "the maintenance to take the node down", interval=0.5)
    step = cluster.status(name)["step"]
    wait_for(lambda: cluster.status(name)["step"] > step + 10, 60, "training on",
             interval=0.5)
    status = cluster.status(name)
    operator.assert_alive()
    assert status["phase"] == "Running", status
    assert status["attempt"] == recovery["attempt"], status["recoveries"]  # untouched by it
    cluster.kubectl("delete", "trainingjob", name, "--wait=false")
