"""Resizing a TPU job by whole slices: a slice that cannot be placed goes as a whole, within
minReplicas, and the bounds themselves must be whole slices."""

from __future__ import annotations

import pytest
from tardigrade_operator.api.parse import InvalidTrainingJob, parse_spec

from tests.operator.fake_cluster import spec
from tests.operator.test_decide_capacity import condition, started

# 2x4 topology, 4 chips a host: 2 hosts a slice.
TPU = {"kind": "tpu", "type": "tpu-v5-lite-podslice", "topology": "2x4", "count": 4}


@pytest.mark.parametrize(("placed", "relaunch"), [
    (3, 2),  # one host of the second slice placed: that slice cannot form, it goes whole
    (2, 2),  # the second slice's pool is gone: one slice left
])
def test_a_slice_that_cannot_be_placed_goes_whole(placed, relaunch):
    cluster, _ = started(4, placed=placed, minReplicas=2, accelerator=TPU)
    cluster.advance(60)
    cluster.reconcile()
    assert cluster.status.phase == "Resizing"
    assert cluster.status.recoveries[-1].to_replicas == relaunch
    assert condition(cluster, "CapacityLimited") == ("True", "Unschedulable")


def test_gpu_gangs_still_shrink_host_by_host():
    cluster, _ = started(4, placed=3, minReplicas=1)
    cluster.advance(60)
    cluster.reconcile()
    assert cluster.status.recoveries[-1].to_replicas == 3


@pytest.mark.parametrize(("field", "value"), [("minReplicas", 1), ("maxReplicas", 5)])
def test_bounds_of_a_tpu_job_are_whole_slices(field, value):
    body = spec(replicas=4, accelerator=TPU, **{field: value})
    with pytest.raises(InvalidTrainingJob) as err:
        parse_spec(body)
    assert f"spec.{field}" in str(err.value)
    assert "set it to a multiple of 2" in str(err.value)
