"""End to end on real nodes: GKE schedules host maintenance on a node of a training gang (the
node label with the start time, then at the start GKE's maintenance handler and the VM's
shutdown through logind). The gang saves and moves off that node before the window: a planned
migration, no step lost. The chart's operator, real multi-process JAX trainers in the
trainer-cpu image on real kubelets; the maintenance is GKE's part
(`RealNodeCluster.schedule_maintenance`; local_cluster/README.md, "Scheduled host
maintenance")."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client import ApiException
from tardigrade_local.gke.disruptions import (
    IMPENDING_TERMINATION_TAINT,
    SCHEDULED_MAINTENANCE_LABEL,
)

from tests.e2e.harness import (
    NEEDS_REAL_NODES,
    InstalledOperator,
    RealCluster,
    real_cluster,
    wait_for,
)

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_NODES,
]

# Inside the job's default lead time (spec.preemption.maintenanceLeadSeconds, 30 min), and
# long enough on a busy 2-core machine for a save, a relaunch and the trainer image's first
# pull on the spare node.
MAINTENANCE_IN = 180.0
# The VM is back under its name that long after its shutdown (the node pool's MIG).
BACK_AFTER = 20.0
NODE_BACK_SECONDS = 300.0
# One trainer per spot node (a node has 2 CPUs): a gang of 2 has a spare node to move to.
SPOT_NODES = 3
ONE_TRAINER = {"cpu": "1100m", "memory": "256Mi"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    # Short: the kubelet's socket paths live under each node's directory.
    with real_cluster(tmp_path_factory.mktemp("mt"), SPOT_NODES) as running:
        yield running


def _node(cluster: RealCluster, name: str) -> Any | None:
    try:
        return cluster.core.read_node(name)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def _ready(node: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True"
               for c in node.status.conditions or [])


def test_gang_moves_off_a_node_before_its_host_maintenance(
        cluster: RealCluster, operator: InstalledOperator):
    name = "e2e-maint"
    job = cluster.trainingjob(name, steps=1_000_000)  # trains for as long as the test looks
    job["spec"]["resources"]["requests"] = dict(ONE_TRAINER)
    job["spec"]["checkpoint"]["interval"] = {"steps": 1000}
    cluster.apply(job)
    log = cluster.step_log(name)
    cluster.wait_phase(name, {"Running"}, timeout=300, collector=log)
    wait_for(lambda: (log.collect(), log.last_step >= 5)[1], 120, "training past step 5",
             interval=0.5)
    victim = next(p for p in cluster.pods(name) if p.metadata.labels["tardigrade.dev/rank"] == "1")
    node = cluster.spot_node_of(victim)
    first_vm = cluster.core.read_node(node).metadata.uid
    start = cluster.real.schedule_maintenance(node, MAINTENANCE_IN, back_after_seconds=BACK_AFTER)
    announced = cluster.core.read_node(node)
    assert announced.metadata.labels[SCHEDULED_MAINTENANCE_LABEL] == str(int(start))
    assert not any(t.key == IMPENDING_TERMINATION_TAINT for t in announced.spec.taints or [])

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

    # The maintenance then takes the VM down (its Node object goes), not before its start;
    # the pool brings a fresh VM back under its name: without the label or the taint.
    def first_vm_gone() -> bool:
        found = _node(cluster, node)
        return found is None or found.metadata.uid != first_vm

    wait_for(first_vm_gone, MAINTENANCE_IN + 120, "the maintenance to take the VM down",
             interval=0.5)
    assert time.time() >= start - 1.0, "the VM went before its maintenance's start"

    def back() -> Any | None:
        found = _node(cluster, node)
        return found if found is not None and _ready(found) else None

    returned = wait_for(back, NODE_BACK_SECONDS, "the VM back under its name")
    assert returned.metadata.uid != first_vm
    assert SCHEDULED_MAINTENANCE_LABEL not in (returned.metadata.labels or {})
    assert not any(t.key == IMPENDING_TERMINATION_TAINT
                   for t in returned.spec.taints or [])
    # The gang is elsewhere and trains on, untouched by the maintenance.
    step = cluster.status(name)["step"]
    wait_for(lambda: cluster.status(name)["step"] > step + 10, 120, "training on",
             interval=0.5)
    status = cluster.status(name)
    operator.assert_alive()
    assert status["phase"] == "Running", status
    assert status["attempt"] == recovery["attempt"], status["recoveries"]
    assert {p.metadata.uid for p in cluster.pods(name)} >= {p.metadata.uid for p in gang}
    cluster.kubectl("delete", "trainingjob", name, "--wait=false")
