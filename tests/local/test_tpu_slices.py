"""TPU slice node pools, pure: a slice pool's hosts, their shape, and a host's slice. That the
hosts of a slice are reclaimed and recreated together and that a gang keeps to one slice is
asserted on real nodes (tests/e2e/test_tpu_slices.py)."""

from __future__ import annotations

import pytest
from tardigrade_local.gke import realreclaim, tpuslices
from tardigrade_local.gke.nodes import NodeConfig, node_object
from tardigrade_local.gke.tpuslices import SliceShape, slice_nodes, slice_of

SHAPE = SliceShape("tpu-v5-lite-podslice", "2x4", 4)


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


def test_the_cloud_finds_a_hosts_slice_from_the_node_objects():
    """`realreclaim.slice_hosts`, what the control endpoint acts on for `tardigrade local
    preempt/halt/maintenance` of a real node: the Nodes as the API server has them (labels
    and capacity; a kubelet adds its own labels and capacity beside the pool's)."""
    one, two = slice_nodes("s1", SHAPE), slice_nodes("s2", SHAPE)
    single = slice_nodes("single", SliceShape("tpu-v5-lite-podslice", "2x2", 4))
    objects = [node_object(config) for config in (*one, *two, NodeConfig("plain"), *single)]
    for found in objects:  # what the kubelet reports beside the pool's figures
        found["status"]["capacity"].update({"cpu": "2", "ephemeral-storage": "100Gi"})
        found["metadata"]["labels"]["kubernetes.io/hostname"] = found["metadata"]["name"]
    assert realreclaim.slice_hosts(objects, "s2-1") == ["s2-0", "s2-1"]
    assert realreclaim.slice_hosts(objects, "plain") == ["plain"]
    assert realreclaim.slice_hosts(objects, "single-0") == ["single-0"]
    # A Node gone already (deleted by a reclaim under way) is just itself.
    assert realreclaim.slice_hosts(objects, "gone") == ["gone"]
