"""End to end on real nodes: a node lost without a shutdown under a gang with a memory tier.
The surviving rank is kept and restarted in place by its real kubelet (its memory volume, an
emptyDir of medium Memory, with it), the lost rank's new pod reads its shards from the
survivor's replica over the pod network, and the gang loses at most about one memory interval
instead of everything since the bucket's last commit. The chart's operator, real JAX trainers
in the trainer-cpu image on real kubelets; the VM's halt is GKE's part
(`RealNodeCluster.halt`, local_cluster/README.md, "Ungraceful node loss")."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.harness import (
    NAMESPACE,
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

# Fast node-loss detection: the kubelets renew a 4 s Lease every second; kube-controller-
# manager looks every second and marks a node whose Lease went unrenewed for 6 s Unknown
# (short, yet not so short that a real kubelet on a loaded 2-core machine flaps).
NODE_LEASE = 4
NODE_MONITOR_PERIOD = 1.0
NODE_MONITOR_GRACE = 6.0
NODE_LOST_AFTER = 10.0
MEMORY_INTERVAL = 5
BUCKET_INTERVAL = 100
# A pod that cannot be placed this long shrinks a gang above its minReplicas.
UNSCHEDULABLE_TIMEOUT = 10.0
# One trainer per spot node (a node has 2 CPUs): the first test's gang of 2 has a spare; the
# second's gang of 3 fills them all, so the rank lost has nowhere to go.
SPOT_NODES = 3
ONE_TRAINER = {"cpu": "1100m", "memory": "256Mi"}
# The halted VM boots again this long after (its node pool recreating it): past the first
# test's relaunch onto the spare and the second's shrink; the old pods bound to it are then
# finished by its kubelet, and the next test has every node.
BACK_AFTER = {"e2e-memloss": 60.0, "e2e-memshrink": 120.0}
NODE_BACK_SECONDS = 300.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    # Short: the kubelet's socket paths live under each node's directory.
    with real_cluster(tmp_path_factory.mktemp("mem"), SPOT_NODES, node_lease_seconds=NODE_LEASE,
                      node_monitor_period_seconds=NODE_MONITOR_PERIOD,
                      node_monitor_grace_seconds=NODE_MONITOR_GRACE) as running:
        yield running


# Added to the chart's install (tests/e2e/conftest.py's `operator`).
OPERATOR_HELM_VALUES = (
    "--set", "operator.restartInPlace=true",
    "--set", f"operator.nodeLostAfterSeconds={NODE_LOST_AFTER:g}",
    "--set", f"operator.unschedulableTimeoutSeconds={UNSCHEDULABLE_TIMEOUT:g}",
)


@pytest.fixture(autouse=True)
def _every_node_back(cluster: RealCluster) -> Iterator[None]:
    """After each test: its job and pods gone (the halted VM's back, its kubelet finished
    them), every spot node Ready for the next."""
    yield
    cluster.clear_jobs()
    wait_for(lambda: all(_ready(cluster, plan.name) == "True"
                         for plan in cluster.real.plan), NODE_BACK_SECONDS, "every node Ready")


def _ready(cluster: RealCluster, node: str) -> str:
    try:
        conditions = cluster.core.read_node(node).status.conditions or []
    except Exception:  # not registered (yet)
        return "Absent"
    return next((c.status for c in conditions if c.type == "Ready"), "Unknown")


def _pod_records(cluster: RealCluster, pod: str) -> list[dict[str, Any]]:
    text = cluster.core.read_namespaced_pod_log(pod, NAMESPACE) or ""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _restore_of(cluster: RealCluster, pod: str) -> dict[str, Any] | None:
    return next((r for r in _pod_records(cluster, pod) if r.get("event") == "restore_done"),
                None)


def _memory_job(cluster: RealCluster, name: str, replicas: int) -> dict[str, Any]:
    job = cluster.trainingjob(name, steps=1_000_000, replicas=replicas)  # trains on
    job["spec"]["resources"]["requests"] = dict(ONE_TRAINER)
    job["spec"]["checkpoint"]["interval"] = {"steps": BUCKET_INTERVAL}
    job["spec"]["checkpoint"]["memoryTier"] = {"interval": MEMORY_INTERVAL, "replicas": 1}
    # Every step's state hash in rank 0's log: the restored state is compared bit for bit.
    job["spec"]["trainer"]["debug_state_hash"] = True
    return job


def _assert_continuous(complete: Any, restored: int, old_attempt: int, new_attempt: int,
                       lost: int) -> None:
    """The loss curve goes on as if nothing happened: the state restored is bit for bit the
    state the old gang had at that step, and the steps trained twice (those lost) the same."""
    hashes: dict[tuple[int, int], str] = {(r["attempt"], r["step"]): r["hash"]
                                          for r in complete.records
                                          if r.get("event") == "state_hash"}
    assert hashes[(new_attempt, restored)] == hashes[(old_attempt, restored)]
    losses: dict[tuple[int, int], float] = {(r["attempt"], r["step"]): r["loss"]
                                            for r in complete.records
                                            if r.get("event") == "step"}
    retrained = sorted(s for a, s in losses if a == new_attempt and (old_attempt, s) in losses)
    assert retrained == list(range(restored + 1, restored + lost + 1)), (retrained, lost)
    for step in retrained:
        old, new = losses[(old_attempt, step)], losses[(new_attempt, step)]
        assert abs(old - new) <= 1e-5 * max(1.0, abs(old)), (step, old, new)


def _most_lost(complete: Any, attempt: int, restored: int) -> int:
    """Fewer steps than this are lost (docs/memory-tier.md): 2 intervals, one more for each
    memory step the gang skipped after the one restored (a commit still running then; the
    same steps on every rank, so rank 0's log tells)."""
    skipped = [r["step"] for r in complete.records
               if r.get("event") == "memory_snapshot_skipped" and r.get("attempt") == attempt
               and r["step"] > restored]
    return MEMORY_INTERVAL * (2 + len(skipped))


def _trained_in(complete: Any, attempt: int) -> int:
    return max(r["step"] for r in complete.records
               if r.get("event") == "step" and r.get("attempt") == attempt)


def test_a_node_lost_without_notice_costs_at_most_the_memory_interval(
        cluster: RealCluster, operator: InstalledOperator):
    name = "e2e-memloss"
    job = _memory_job(cluster, name, replicas=2)
    cluster.apply(job)
    log = cluster.step_log(name)
    # Past the first memory snapshots (every rank's written and sent).
    wait_for(lambda: (log.collect(), log.last_step >= 3 * MEMORY_INTERVAL)[1], 300,
             "training past a few memory snapshots")
    pods = {p.metadata.labels["tardigrade.dev/rank"]: p for p in cluster.pods(name)}
    survivor, victim = pods["0"], pods["1"]
    assert survivor.spec.node_name != victim.spec.node_name
    halted = time.monotonic()
    cluster.real.halt(victim.spec.node_name, back_after_seconds=BACK_AFTER[name])

    def recovered() -> dict[str, Any] | None:
        log.collect()
        status = cluster.status(name)
        recoveries = status.get("recoveries") or []
        return status if recoveries and recoveries[-1].get("gangFormedTime") else None

    status = wait_for(recovered, 180, "the gang formed again")
    recovery = status["recoveries"][-1]
    assert recovery["cause"] == "Preemption", recovery
    assert recovery["keptPods"] == 1 and recovery["recreatedRanks"] == "1", recovery
    # Bounded by the node monitor's grace, the operator's tolerance and a restart: not by
    # JAX's heartbeat timeout, which would have aborted the survivor and its memory.
    assert time.monotonic() - halted < NODE_MONITOR_GRACE + NODE_LOST_AFTER + 90
    # The survivor's pod is the same pod, its trainer restarted in it by its kubelet.
    kept = cluster.core.read_namespaced_pod(survivor.metadata.name, NAMESPACE)
    assert kept.metadata.uid == survivor.metadata.uid
    assert kept.status.container_statuses[0].restart_count == 1
    assert kept.status.container_statuses[0].last_state.terminated.exit_code == 77
    replacement = f"{name}-a2-1"

    restores = wait_for(lambda: (lambda r0, r1: (r0, r1) if r0 and r1 else None)(
        _restore_of(cluster, survivor.metadata.name), _restore_of(cluster, replacement)),
        120, "both ranks' restores")
    restored = restores[0]["step"]
    assert restores[1]["step"] == restored
    # Rank 0 from its own memory, the lost rank 1 from rank 0's replica: nothing from the
    # bucket, whose newest commit is older.
    assert (restores[0]["source"], restores[1]["source"]) == ("memory", "peer"), restores
    assert restored % MEMORY_INTERVAL == 0
    wait_for(lambda: (log.collect(), log.last_step >= restored + 2 * MEMORY_INTERVAL)[1], 120,
             "training on after the restore")
    complete = cluster.complete_log(name)
    trained_before = _trained_in(complete, 1)
    committed = [r["step"] for r in complete.records
                 if r.get("event") == "checkpoint_committed" and r.get("attempt") == 1]
    assert restored > max(committed, default=0), (restored, committed)
    lost = trained_before - restored
    # The newest snapshot whole on every rank: at most one interval behind the last step,
    # one more where the loss fell while the last snapshot was still being sent, and one
    # more for each memory step skipped since.
    assert 0 <= lost <= _most_lost(complete, 1, restored), (trained_before, restored)
    assert recovery.get("stepsLost") is None or recovery["stepsLost"] <= lost
    _assert_continuous(complete, restored, 1, 2, lost)
    # The survivor left on the operator's word, without trying a save the lost rank would
    # never have joined.
    left = [r for r in complete.records if r.get("event") == "restart_for_lost_ranks"]
    assert [r["lost"] for r in left] == [[1]], left
    assert not any(r.get("event") in ("preempted_unsaved", "preempted")
                   for r in complete.records if r.get("attempt") == 1)
    operator.assert_alive()
    assert cluster.status(name)["restarts"]["failures"] == 0
    cluster.kubectl("delete", "trainingjob", name, "--wait=false")


def test_a_node_lost_with_no_spare_shrinks_the_gang_and_reshards_from_memory(
        cluster: RealCluster, operator: InstalledOperator):
    name = "e2e-memshrink"
    job = _memory_job(cluster, name, replicas=3)
    job["spec"]["minReplicas"] = 2
    cluster.apply(job)
    log = cluster.step_log(name)
    wait_for(lambda: (log.collect(), log.last_step >= 3 * MEMORY_INTERVAL)[1], 300,
             "training past a few memory snapshots")
    pods = {p.metadata.labels["tardigrade.dev/rank"]: p for p in cluster.pods(name)}
    # The last rank's node: ranks 0 and 1 hold their own snapshots and, on the ring, rank 2's
    # (rank 0) and rank 0's (rank 1). A middle rank lost would leave its replica on rank 2,
    # which a gang of 2 cannot keep (a kept pod keeps its rank): the bucket then.
    cluster.real.halt(pods["2"].spec.node_name, back_after_seconds=BACK_AFTER[name])

    def shrunk() -> dict[str, Any] | None:
        log.collect()
        status = cluster.status(name)
        recoveries = status.get("recoveries") or []
        return status if recoveries and recoveries[-1]["cause"] == "Resize" and \
            recoveries[-1].get("gangFormedTime") else None

    status = wait_for(shrunk, 240, "the gang shrunk to 2 and formed")
    assert status["replicas"] == 2
    causes = [r["cause"] for r in status["recoveries"]]
    assert causes == ["Preemption", "Resize"], status["recoveries"]
    attempt = status["attempt"]
    kept = [pods["0"].metadata.name, pods["1"].metadata.name]
    restores = wait_for(lambda: (lambda found: found if all(found) else None)(
        [_restore_of(cluster, pod) for pod in kept]), 120, "both ranks' restores")
    restored = restores[0]["step"]
    assert restores[1]["step"] == restored
    records = [_pod_records(cluster, pod) for pod in kept]
    decisions = [next(r for r in rank if r.get("event") == "memory_tier_decision")
                 for rank in records]
    memory = [next(r for r in rank if r.get("event") == "memory_tier_restored")
              for rank in records]
    # Written by 3 ranks, read by 2: the step whole across the two survivors' memories (the
    # lost rank 2's snapshot on rank 0, its ring successor), each rank reading it resharded
    # onto the new mesh (a data-parallel state: one owner's pieces cover a rank's devices).
    for decision in decisions:
        assert decision["step"] == restored and decision["saved_process_count"] == 3
        assert decision["sources"][2] == 0, decision
    assert all(m["saved_process_count"] == 3 and m["step"] == restored for m in memory), memory
    assert [r["source"] for r in restores] == ["resharded", "resharded"], restores
    wait_for(lambda: (log.collect(), log.last_step >= restored + 2 * MEMORY_INTERVAL)[1], 120,
             "training on after the restore")
    # Rank 0's pod restarted twice: its kubelet keeps only the run before the current one,
    # so the log read while it ran (log.collect after each restart) has attempt 1's steps.
    lost = _trained_in(log, 1) - restored
    assert 0 <= lost <= _most_lost(log, 1, restored), (lost, restored)
    _assert_continuous(log, restored, 1, attempt, lost)
    operator.assert_alive()
    assert cluster.status(name)["restarts"]["failures"] == 0
    cluster.kubectl("delete", "trainingjob", name, "--wait=false")
