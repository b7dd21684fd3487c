"""End to end on real nodes, multislice on TPU slice node pools with the chart's operator and
real trainers in the trainer-cpu image: 2 slices x 2 hosts, each host a real node of its slice
pool's NodeConfig (the TPU labels and taint, 4 chips of google.com/tpu advertised, no device:
the trainers run on the CPU). One slice is reclaimed (`RealNodeCluster.reclaim` of one host
shuts down every VM of the slice through the real kubelets' graceful node shutdown, as GKE
does), the job shrinks to the other slice and trains on; the pool recreates the hosts under
their names and the job grows back to 2 slices. No step is lost with the notice, and the loss
curve goes on where it was."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tardigrade_local.gke.nodes import NODE_POOL_LABEL
from tardigrade_local.gke.tpuslices import SliceShape, slice_nodes
from tardigrade_local.realcluster import NodePlan, plan_nodes

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

SHAPE = SliceShape("tpu-v5-lite-podslice", "2x4", 4)  # 2 hosts of 4 chips a slice
TPU = {"kind": "tpu", "type": SHAPE.accelerator, "topology": SHAPE.topology,
       "count": SHAPE.chips_per_host}
# A host's allocatable, well within this 2-core machine (nodeshape.py): one trainer a host
# (its 4 chips fill it).
HOST_CAPACITY = {"cpu": "1", "memory": "4Gi", "pods": "20"}
# The slice pools' hosts are CPUs: the job says so, or its trainers would stop at once
# (AcceleratorUnavailable) rather than train on the CPU of a job that asked for TPUs.
ON_CPU = {"name": "JAX_PLATFORMS", "value": "cpu"}
UNSCHEDULABLE_TIMEOUT_SECONDS = 15
GROW_BACK_AFTER_SECONDS = 30
# Longer than the operator's unschedulable timeout and a gang restart: the job shrinks first.
SLICE_BACK_AFTER_SECONDS = 40.0
# Nodes' boots, the trainer image's pull onto each fresh disk, JAX's start, 4 ranks on 2 cores.
NODES_AND_TRAINERS_SECONDS = 420.0

# Added to the chart's install (tests/e2e/conftest.py's `operator`).
OPERATOR_HELM_VALUES = (
    "--set", f"operator.unschedulableTimeoutSeconds={UNSCHEDULABLE_TIMEOUT_SECONDS}",
    "--set", f"operator.growBackAfterSeconds={GROW_BACK_AFTER_SECONDS}",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    # The operator's on-demand node, and the hosts of two spot slice pools.
    hosts = [NodePlan.of(config) for pool in ("tpu-slice-1", "tpu-slice-2")
             for config in slice_nodes(pool, SHAPE, host_capacity=HOST_CAPACITY)]
    with real_cluster(tmp_path_factory.mktemp("ts"), 0,
                      nodes=[*plan_nodes(1, 0), *hosts]) as running:
        yield running


def _pools(cluster: RealCluster, name: str, attempt: int) -> dict[str, str]:
    """Slice label -> node pool of the hosts of one attempt."""
    pools: dict[str, set[str]] = {}
    for pod in cluster.pods(name):
        labels = pod.metadata.labels
        if labels["tardigrade.dev/attempt"] != str(attempt) or not pod.spec.node_name:
            continue
        node = cluster.core.read_node(pod.spec.node_name)
        pools.setdefault(labels["tardigrade.dev/slice"], set()).add(
            node.metadata.labels[NODE_POOL_LABEL])
    assert all(len(p) == 1 for p in pools.values()), pools  # a slice never spans pools
    return {s: next(iter(p)) for s, p in pools.items()}


def test_losing_a_slice_shrinks_to_the_other_and_its_return_grows_back(
        cluster: RealCluster, operator: InstalledOperator):
    name = "multi"
    job = cluster.trainingjob(name, steps=100000, replicas=4, minReplicas=2, maxReplicas=4,
                              accelerator=TPU, spot={"enabled": True})
    job["spec"]["env"].append(ON_CPU)
    cluster.apply(job)
    log = cluster.step_log(name)
    wait_for(lambda: (log.collect(), log.last_step >= 5)[1], NODES_AND_TRAINERS_SECONDS,
             "training to pass step 5")
    first = _pools(cluster, name, 1)
    assert sorted(first.values()) == ["tpu-slice-1", "tpu-slice-2"]
    victim = next(p.spec.node_name for p in cluster.pods(name)
                  if p.metadata.labels["tardigrade.dev/slice"] == f"{name}-a1-s1")
    pool = cluster.core.read_node(victim).metadata.labels[NODE_POOL_LABEL]
    # GKE's reclaim of one host takes the whole slice; its pool recreates every host.
    cluster.real.reclaim(victim, replace_after_seconds=SLICE_BACK_AFTER_SECONDS)
    hosts = {f"{pool}-0", f"{pool}-1"}
    names = {n.metadata.name for n in cluster.core.list_node().items}
    assert not hosts & names, names
    seen: list[tuple[int, int, str]] = []

    def at(replicas: int, after_attempt: int) -> bool:
        log.collect()
        status = cluster.status(name)
        seen.append((status.get("attempt", 0), status.get("replicas", 0),
                     status.get("phase", "")))
        return (status.get("attempt", 0) > after_attempt and status.get("phase") == "Running"
                and status.get("replicas") == replicas)

    wait_for(lambda: at(2, 1), 300, "the job running on the one slice left")
    shrunk = cluster.status(name)["attempt"]
    steps_then = log.last_step
    wait_for(lambda: (log.collect(), log.last_step >= steps_then + 3)[1], 180,
             "training to go on on one slice")
    wait_for(lambda: at(4, shrunk), SLICE_BACK_AFTER_SECONDS + NODES_AND_TRAINERS_SECONDS,
             "the job grown back to 2 slices")
    grown = cluster.status(name)["attempt"]
    assert len(_pools(cluster, name, grown)) == 2
    assert hosts <= {n.metadata.name for n in cluster.core.list_node().items}
    operator.assert_alive()
    status = cluster.status(name)
    recoveries = status["recoveries"]
    preempted = [r for r in recoveries if r["cause"] == "Preemption"]
    assert preempted and all(r.get("stepsLost") == 0 for r in preempted), recoveries
    resized = [(r.get("fromReplicas"), r.get("toReplicas")) for r in recoveries
               if r["cause"] == "Resize"]
    assert (4, 2) in resized and (2, 4) in resized, (recoveries, seen)
    # Every restore was a committed step, and the curve has every step once it resumed. From
    # the logs as shipped off the nodes: the notice's commit is in the last lines of pods the
    # slice's shutdown deleted, which a real kubelet removes at once.
    complete = cluster.complete_log(name)
    assert complete.restored and set(complete.restored) <= set(complete.committed)
    curve = complete.curve()
    assert all(step in curve for step in range(1, log.last_step + 1))
    cluster.kubectl("delete", "trainingjob", name, "-n", "default", "--wait=false")
