"""End to end, multislice on TPU slice node pools (CPU trainers): 2 slices x 2 hosts; one
slice's pool is reclaimed, the job shrinks to the other slice and trains on; the pool comes
back and the job grows back to 2 slices. No step is lost with the notice, and the loss curve
goes on where it was."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.gke.tpuslices import SliceShape, slice_nodes

from tests.e2e.harness import Cluster, OperatorProcess, running_operator, trainingjob, wait_for

pytestmark = pytest.mark.slow

SHAPE = SliceShape("tpu-v5-lite-podslice", "2x4", 4)  # 2 hosts of 4 chips a slice
TPU = {"kind": "tpu", "type": SHAPE.accelerator, "topology": SHAPE.topology,
       "count": SHAPE.chips_per_host}
# The local slice pools' hosts are CPUs: the job says so, or its trainers would stop at once
# (AcceleratorUnavailable) rather than train on the CPU of a job that asked for TPUs.
ON_CPU = [{"name": "JAX_PLATFORMS", "value": "cpu"}]
UNSCHEDULABLE_TIMEOUT_SECONDS = 15
GROW_BACK_AFTER_SECONDS = 30
SLICE_BACK_AFTER_SECONDS = 40.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("slices")
    nodes = slice_nodes("tpu-slice-1", SHAPE) + slice_nodes("tpu-slice-2", SHAPE)
    with LocalCluster(root / "cluster", nodes=nodes) as local:
        yield Cluster(local)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    env = {"TARDIGRADE_UNSCHEDULABLE_TIMEOUT_SECONDS": str(UNSCHEDULABLE_TIMEOUT_SECONDS),
           "TARDIGRADE_GROW_BACK_AFTER_SECONDS": str(GROW_BACK_AFTER_SECONDS)}
    with running_operator(cluster, tmp_path_factory.mktemp("op"), env=env) as process:
        yield process


def _pools(cluster: Cluster, name: str, attempt: int) -> dict[str, str]:
    """Slice label -> node pool of the hosts of one attempt."""
    pools: dict[str, set[str]] = {}
    for pod in cluster.pods(name):
        labels = pod.metadata.labels
        if labels["tardigrade.dev/attempt"] != str(attempt) or not pod.spec.node_name:
            continue
        node = cluster.core.read_node(pod.spec.node_name)
        pools.setdefault(labels["tardigrade.dev/slice"], set()).add(
            node.metadata.labels["cloud.google.com/gke-nodepool"])
    assert all(len(p) == 1 for p in pools.values()), pools  # a slice never spans pools
    return {s: next(iter(p)) for s, p in pools.items()}


def test_losing_a_slice_shrinks_to_the_other_and_its_return_grows_back(
        cluster: Cluster, operator: OperatorProcess):
    name = "multi"
    cluster.apply(trainingjob(name, steps=100000, replicas=4, minReplicas=2, maxReplicas=4,
                              accelerator=TPU, spot={"enabled": True}, env=ON_CPU))
    log = cluster.step_log(name)
    wait_for(lambda: (log.collect(), log.last_step >= 5)[1], 300, "training to pass step 5")
    first = _pools(cluster, name, 1)
    assert sorted(first.values()) == ["tpu-slice-1", "tpu-slice-2"]
    victim = next(p.spec.node_name for p in cluster.pods(name)
                  if p.metadata.labels["tardigrade.dev/slice"] == f"{name}-a1-s1")
    cluster.local.preempt_node(victim, replace_after_seconds=SLICE_BACK_AFTER_SECONDS)
    seen: list[tuple[int, int, str]] = []

    def at(replicas: int, after_attempt: int) -> bool:
        log.collect()
        status = cluster.status(name)
        seen.append((status.get("attempt", 0), status.get("replicas", 0),
                     status.get("phase", "")))
        return (status.get("attempt", 0) > after_attempt and status.get("phase") == "Running"
                and status.get("replicas") == replicas)

    wait_for(lambda: at(2, 1), 240, "the job running on the one slice left")
    shrunk = cluster.status(name)["attempt"]
    steps_then = log.last_step
    wait_for(lambda: (log.collect(), log.last_step >= steps_then + 3)[1], 120,
             "training to go on on one slice")
    wait_for(lambda: at(4, shrunk), 300, "the job grown back to 2 slices")
    grown = cluster.status(name)["attempt"]
    assert len(_pools(cluster, name, grown)) == 2
    operator.assert_alive()
    status = cluster.status(name)
    recoveries = status["recoveries"]
    preempted = [r for r in recoveries if r["cause"] == "Preemption"]
    assert preempted and all(r.get("stepsLost") == 0 for r in preempted), recoveries
    resized = [(r.get("fromReplicas"), r.get("toReplicas")) for r in recoveries
               if r["cause"] == "Resize"]
    assert (4, 2) in resized and (2, 4) in resized, recoveries
    # Every restore was a committed step, and the curve has every step once it resumed.
    assert set(log.restored) <= set(log.committed)
    curve = cluster.complete_log(name).curve()
    assert all(step in curve for step in range(1, log.last_step + 1))
    cluster.kubectl("delete", "trainingjob", name, "-n", "default", "--wait=false")
