"""End to end, restart in place on: the local cluster, the real operator, real JAX trainers.

Three one-trainer nodes (1 CPU each, the trainer asks for 1): two run a 1.36 kubelet with
ContainerRestartRules, one a 1.33 kubelet that ignores restart rules. So every gang has ranks
that can restart in place and, when it spans three nodes, one that must be recreated. Every test
runs twice: kept trainers restarted by their kubelet (exit 77), and restarted in process
(exec, TARDIGRADE_RESTART_IN_PROCESS), where no kept container restarts and the old kubelet's
pod is kept too."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.kubelet import NodeConfig
from tardigrade_local.steplog import StepLog

from tests.e2e.harness import (
    Cluster,
    OperatorProcess,
    assert_goodput_adds_up,
    running_operator,
    trainingjob,
    wait_for,
)

pytestmark = pytest.mark.slow

GRACE_SECONDS = 20
ONE_TRAINER = {"cpu": "1"}
GATES = {"ContainerRestartRules": True}
OLD_NODE = "old-kubelet"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("inplace")
    nodes = [NodeConfig("new-a", capacity=ONE_TRAINER, kubelet_version="v1.36.0",
                        feature_gates=GATES),
             NodeConfig("new-b", capacity=ONE_TRAINER, kubelet_version="v1.36.0",
                        feature_gates=GATES),
             NodeConfig(OLD_NODE, capacity=ONE_TRAINER, kubelet_version="v1.33.0")]
    with LocalCluster(root / "cluster", nodes=nodes, shutdown_grace_seconds=GRACE_SECONDS,
                      feature_gates="ContainerRestartRules=true") as local:
        yield Cluster(local)


@pytest.fixture(scope="module", params=["by kubelet", "in process"])
def operator(request: pytest.FixtureRequest, cluster: Cluster,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    in_process = request.param == "in process"
    with running_operator(cluster, tmp_path_factory.mktemp("operator"),
                          env={"TARDIGRADE_RESTART_IN_PLACE": "true",
                               "TARDIGRADE_RESTART_IN_PROCESS": str(in_process).lower()}
                          ) as process:
        process.in_process = in_process  # type: ignore[attr-defined]
        yield process


@pytest.fixture(autouse=True)
def _one_job_at_a_time(cluster: Cluster) -> Iterator[None]:
    yield
    cluster.clear_jobs()


def _pods(cluster: Cluster, name: str) -> dict[str, Any]:
    return {p.metadata.name: p for p in cluster.pods(name) if p.metadata.deletion_timestamp
            is None}


def _name(base: str, operator: OperatorProcess) -> str:
    """One name (and checkpoint path) per way of restarting: the second run must not find
    the first's checkpoints."""
    return f"{base}-exec" if _in_process(operator) else base


def _in_process(operator: OperatorProcess) -> bool:
    """The operator of this run restarts kept trainers in process (the fixture's param)."""
    return bool(getattr(operator, "in_process", False))


def _restarts(pod: Any) -> int:
    return max((s.restart_count or 0 for s in pod.status.container_statuses or []), default=0)


def _train_past(log: StepLog, step: int) -> None:
    wait_for(lambda: (log.collect(), log.last_step >= step)[1], 300, f"training past {step}")


def _wait_running(cluster: Cluster, log: StepLog, name: str, field: str, value: int,
                  what: str) -> None:
    """Until the job is Running with status `field` at `value`, after its one recovery; a job
    that went on to another recovery, or ended, fails at once with its status."""

    def running() -> dict[str, Any] | None:
        log.collect()
        status = cluster.status(name)
        if status.get("attempt", 0) > 2 or status.get("phase") in ("Succeeded", "Failed"):
            raise AssertionError(f"waiting for {what}, {name} went on: {status}")
        return status if status.get(field) == value and status.get("phase") == "Running" \
            else None

    wait_for(running, 300, what)


def _assert_every_step_trained(cluster: Cluster, name: str, steps: int) -> None:
    """From the kubelets' files: the API loses a deleted pod's lines the test had not read."""
    losses = cluster.complete_log(name).losses
    missing = [s for s in range(1, steps + 1) if s not in losses]
    assert not missing, f"no loss logged for steps {missing[:10]}"


def _assert_kept_and_recreated(before: dict[str, Any], after: dict[str, Any],
                               lost: set[str], operator: OperatorProcess,
                               log: StepLog) -> None:
    """Pods that were not lost stay (same uid) where their trainer can restart: on 1.36 nodes
    by the kubelet, or on any node in process with the container untouched; the rest are
    new."""
    for name, pod in before.items():
        old_kubelet = pod.spec.node_name == OLD_NODE and not _in_process(operator)
        if old_kubelet or name in lost:
            assert name not in after, f"{name} on {pod.spec.node_name} should be recreated"
            continue
        assert name in after, f"{name} on {pod.spec.node_name} was not kept"
        assert after[name].metadata.uid == pod.metadata.uid
        if _in_process(operator):
            assert _restarts(after[name]) == 0, f"{name}'s container restarted"
        else:
            assert _restarts(after[name]) >= 1, f"{name} was kept but never restarted"
    rank0 = next(name for name, pod in before.items()
                 if pod.metadata.labels["tardigrade.dev/rank"] == "0")
    if _in_process(operator) and rank0 in after:
        # Rank 0 was kept: its trainer said it would restart in process (the step log reads
        # rank 0's pods only).
        said = [r for r in log.records if r.get("event") == "restart_in_place"]
        assert said and said[-1]["in_process"] is True, said
        # Its new attempt is a new child of the same container process (attempts.py), which
        # kept its imports: none were paid again.
        starts = {r["attempt"]: r for r in log.records if r.get("event") == "startup"}
        old, new = (starts[a] for a in sorted(starts)[-2:])
        assert new["keeper_pid"] == old["keeper_pid"] and new["pid"] != old["pid"], starts
        assert new["imports_done"] - new["process_started"] < 0.05, new


def test_preemption_of_one_rank_restarts_the_others_in_place(cluster: Cluster,
                                                             operator: OperatorProcess):
    name = _name("inplace-preempt", operator)
    job = trainingjob(name, steps=50, replicas=3)
    job["spec"]["checkpoint"]["interval"] = {"steps": 1000}  # only the coordinated save
    cluster.apply(job)
    log = cluster.step_log(name)
    _train_past(log, 8)
    before = _pods(cluster, name)
    assert {p.spec.node_name for p in before.values()} == {"new-a", "new-b", OLD_NODE}
    victim = next(p for p in before.values() if p.spec.node_name == "new-a")
    cluster.local.preempt_node("new-a", grace_seconds=GRACE_SECONDS, replace_after_seconds=1)
    _wait_running(cluster, log, name, "attempt", 2, "the gang running again")
    after = _pods(cluster, name)
    _assert_kept_and_recreated(before, after, {victim.metadata.name}, operator, log)
    status = cluster.wait_phase(name, {"Succeeded"}, timeout=420, collector=log)
    operator.assert_alive()
    assert status["restarts"]["preemptions"] == 1 and status["restarts"]["failures"] == 0
    recovery = status["recoveries"][0]
    assert recovery["cause"] == "Preemption", recovery
    # In process the rank on the old kubelet is kept too.
    assert recovery["keptPods"] == (2 if _in_process(operator) else 1), recovery
    assert recovery["stepsLost"] == 0, recovery
    assert recovery["restoreStep"] >= 8 and recovery["downtimeSeconds"] > 0
    _assert_every_step_trained(cluster, name, 50)
    assert_goodput_adds_up(cluster, name)


def test_resize_keeps_the_gang_and_adds_a_rank(cluster: Cluster, operator: OperatorProcess):
    name = _name("inplace-resize", operator)
    job = trainingjob(name, steps=50, replicas=2)
    job["spec"]["checkpoint"]["interval"] = {"steps": 1000}
    cluster.apply(job)
    log = cluster.step_log(name)
    _train_past(log, 8)
    before = _pods(cluster, name)
    cluster.kubectl("scale", f"tj/{name}", "--replicas=3")
    _wait_running(cluster, log, name, "replicas", 3, "3 ranks running")
    after = _pods(cluster, name)
    assert len(after) == 3
    _assert_kept_and_recreated(before, after, set(), operator, log)
    status = cluster.wait_phase(name, {"Succeeded"}, timeout=420, collector=log)
    recovery = status["recoveries"][0]
    assert recovery["cause"] == "Resize" and recovery["toReplicas"] == 3
    kept = sum(p.spec.node_name != OLD_NODE or _in_process(operator)
               for p in before.values())
    assert recovery["keptPods"] == kept, recovery
    assert recovery["stepsLost"] == 0, recovery
    _assert_every_step_trained(cluster, name, 50)
