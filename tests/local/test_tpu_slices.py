"""TPU slice node pools in the local cluster: the hosts of a slice are reclaimed and recreated
together, and pods with the exclusive-slice affinity keep to one slice."""

from __future__ import annotations

import pytest
from kube_helpers import Kube, python_pod, wait_for
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.gke import tpuslices
from tardigrade_local.gke.nodes import NODE_POOL_LABEL, NodeConfig
from tardigrade_local.gke.tpuslices import SliceShape, slice_nodes, slice_of
from tardigrade_operator.rendering.slice_placement import SLICE_LABEL, exclusive_affinity

SHAPE = SliceShape("tpu-v5-lite-podslice", "2x4", 4)

# --------------------------------------------------------------------------------- pure ---


def test_a_slice_pool_has_topology_over_chips_hosts_with_gke_labels_and_taint():
    nodes = slice_nodes("tpu-slice-1", SHAPE)
    assert [n.name for n in nodes] == ["tpu-slice-1-0", "tpu-slice-1-1"]
    for node in nodes:
        assert node.pool == "tpu-slice-1"
        assert node.labels[tpuslices.TPU_ACCELERATOR_LABEL] == "tpu-v5-lite-podslice"
        assert node.labels[tpuslices.TPU_TOPOLOGY_LABEL] == "2x4"
        assert node.capacity[tpuslices.TPU_RESOURCE] == "4"
        assert node.taints == (tpuslices.TPU_TAINT,)
    assert len(slice_nodes("big", SliceShape("tpu-v5p-slice", "4x4x4", 4))) == 16


@pytest.mark.parametrize(("text", "error"), [
    ("tpu-v5-lite-podslice:2x4", "expected ACCELERATOR:TOPOLOGY:CHIPS"),
    ("tpu-v5-lite-podslice:2x4:0", "expected ACCELERATOR:TOPOLOGY:CHIPS"),
    ("tpu-v5-lite-podslice:2x3:4", "not whole hosts of 4"),
    ("tpu-v5-lite-podslice:2by4:4", "expected AxB or AxBxC"),
])
def test_a_bad_slice_shape_says_what_is_expected(text, error):
    with pytest.raises(ValueError, match=error):
        SliceShape.parse(text)


def test_a_host_of_a_multi_host_slice_takes_its_whole_pool_with_it():
    one, two = slice_nodes("s1", SHAPE), slice_nodes("s2", SHAPE)
    plain = NodeConfig("plain")
    single = slice_nodes("single", SliceShape("tpu-v5-lite-podslice", "2x2", 4))
    everything = [*one, *two, plain, *single]
    assert slice_of(one[1], everything) == one
    assert slice_of(plain, everything) == [plain]
    assert slice_of(single[0], everything) == single  # a single-host slice is just itself


# ------------------------------------------------------------------- against the cluster ---


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("tpu") / "state"
    nodes = slice_nodes("tpu-slice-1", SHAPE) + slice_nodes("tpu-slice-2", SHAPE)
    with LocalCluster(state, nodes=nodes, with_gcs=False, shutdown_grace_seconds=1,
                      replace_after_seconds=2.0) as running:
        yield running


@pytest.fixture(scope="module")
def kube(cluster):
    return Kube(str(cluster.kubeconfig))


def _host_pod(name: str, slice_value: str) -> dict:
    return python_pod(
        name, "import time; time.sleep(600)", grace=1, labels={SLICE_LABEL: slice_value},
        affinity=exclusive_affinity(slice_value),
        tolerations=[{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
        container={"resources": {"limits": {"google.com/tpu": "4"}}})


def _pools(kube: Kube, names: list[str]) -> set[str]:
    pools = set()
    for name in names:
        node = kube.core.read_namespaced_pod(name, "default").spec.node_name
        pools.add(kube.core.read_node(node).metadata.labels[NODE_POOL_LABEL])
    return pools


@pytest.mark.slow
def test_gangs_keep_to_their_own_slice_and_a_reclaim_takes_the_whole_slice(cluster, kube):
    pods = {"a-0": "job-a-s0", "b-0": "job-b-s0", "a-1": "job-a-s0", "b-1": "job-b-s0"}
    for name, value in pods.items():
        kube.create_pod(_host_pod(name, value))
    wait_for(lambda: all(kube.core.read_namespaced_pod(n, "default").spec.node_name
                         for n in pods), timeout=30, what="all hosts bound")
    pool_a, pool_b = _pools(kube, ["a-0", "a-1"]), _pools(kube, ["b-0", "b-1"])
    assert len(pool_a) == 1 and len(pool_b) == 1 and pool_a != pool_b
    (pool,) = pool_a
    victim = kube.core.read_namespaced_pod("a-0", "default").spec.node_name
    cluster.preempt_node(victim, wait=True)
    names = kube.node_names()
    assert not any(n.startswith(f"{pool}-") for n in names), names
    (other,) = pool_b
    assert {f"{other}-0", f"{other}-1"} <= names
    wait_for(lambda: {f"{pool}-0", f"{pool}-1"} <= kube.node_names(), timeout=30,
             what=f"every host of {pool} recreated")
