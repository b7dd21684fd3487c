"""End to end on simulated nodes: the real operator (its image's virtualenv) recovers a gang of
16 simulated ranks from a spot reclaim of one host, exactly as it would a real gang."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tardigrade_local.cluster import LocalCluster, simulated_nodes
from tardigrade_local.kubelet.config import SIMULATED_ANNOTATION

from tests.e2e.harness import NAMESPACE, Cluster, OperatorProcess, running_operator, wait_for

pytestmark = pytest.mark.slow

RANKS = 16
NAME = "sim-gang"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("simgang")
    # One rank per host, and one spare host for the rank whose host is reclaimed.
    nodes = simulated_nodes(RANKS + 1, capacity={"cpu": "1"})
    with LocalCluster(root / "cluster", nodes=nodes, with_gcs=False) as local:
        yield Cluster(local)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    with running_operator(cluster, tmp_path_factory.mktemp("operator")) as process:
        yield process


def gang_job(checkpoints: Path) -> dict[str, Any]:
    return {
        "apiVersion": "tardigrade.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {"replicas": RANKS, "image": "ghcr.io/tardigrade-dev/tardigrade-trainer:0.1.0",
                 "resources": {"requests": {"cpu": "1"}},
                 "trainer": {"steps": 1_000_000, "step_seconds": 0.05},
                 "checkpoint": {"path": str(checkpoints), "interval": {"steps": 20},
                                "saveOnPreemption": True},
                 "failurePolicy": {"backoffSeconds": 0}},
    }


def attempt_pods(cluster: Cluster, attempt: int) -> list[Any]:
    return [p for p in cluster.pods(NAME)
            if p.metadata.labels["tardigrade.dev/attempt"] == str(attempt)]


def test_a_gang_of_simulated_ranks_recovers_from_a_reclaimed_host_without_losing_a_step(
        cluster: Cluster, operator: OperatorProcess, tmp_path: Path):
    nodes = cluster.core.list_node().items
    assert all((n.metadata.annotations or {}).get(SIMULATED_ANNOTATION) == "true" for n in nodes)
    cluster.apply(gang_job(tmp_path / "checkpoints"))
    # Running, and training: the operator read progress from simulated rank 0.
    wait_for(lambda: (cluster.status(NAME).get("phase") == "Running"
                      and (cluster.status(NAME).get("step") or 0) > 0), 120, "a training gang")
    attempt = int(cluster.status(NAME)["attempt"])
    first = attempt_pods(cluster, attempt)
    assert len(first) == RANKS and all(p.status.container_statuses[0].container_id.startswith(
        "simulated://") for p in first)
    victim = next(p for p in first if p.metadata.labels["tardigrade.dev/rank"] == str(RANKS - 1))
    cluster.local.preempt_node(victim.spec.node_name)

    def recovered() -> dict[str, Any] | None:
        status = cluster.status(NAME)
        running = [p for p in attempt_pods(cluster, attempt + 1) if p.status.phase == "Running"]
        ok = status.get("phase") == "Running" and status.get("attempt") == attempt + 1
        return status if ok and len(running) == RANKS else None

    status = wait_for(recovered, 120, "every rank of the next attempt running")
    operator.assert_alive()
    recovery = status["recoveries"][-1]
    assert recovery["cause"] == "Preemption", recovery
    # Every rank saved the same step on the notice (their termination messages, as the
    # kubelet read them), and every rank of the new gang restores exactly that step.
    layout = cluster.local.layout
    messages = [json.loads(layout.termination_log(NAMESPACE, p.metadata.name, "trainer")
                           .read_text()) for p in first]
    assert {m["reason"] for m in messages} == {"PreemptedSaved"}, messages
    saved = {m["checkpoint_step"] for m in messages}
    assert len(saved) == 1, saved
    saved_step = saved.pop()
    assert recovery["restoreStep"] == saved_step, recovery
    restore_env = {next(e.value for e in p.spec.containers[0].env
                        if e.name == "TARDIGRADE_RESTORE_STEP")
                   for p in attempt_pods(cluster, attempt + 1)}
    assert restore_env == {str(saved_step)}
    assert status["restarts"]["preemptions"] == 1
    # And trains on past it.
    wait_for(lambda: (cluster.status(NAME).get("step") or 0) > saved_step, 60, "training again")
