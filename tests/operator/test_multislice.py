"""Multislice: ranks to slices and workers, the TPU/MEGASCALE environment, whole slices only,
and TPU_WORKER_HOSTNAMES within Linux's limit for one environment string."""

from __future__ import annotations

import copy

import pytest
from tardigrade_operator.api.parse import InvalidTrainingJob, parse_trainingjob
from tardigrade_operator.api.types import AcceleratorSpec
from tardigrade_operator.rendering import slice_placement, tpu_layout
from tardigrade_operator.rendering.manifests import GangLaunch, JobRef, build_gang
from tardigrade_operator.rendering.tpu_layout import SliceLayout, layout_for, tpu_environment

from tests.conftest import EXAMPLES, load_yaml
from tests.operator.fake_cluster import pod_env

V5E_2X4 = AcceleratorSpec(kind="tpu", type="tpu-v5-lite-podslice", topology="2x4", count=4)


@pytest.mark.parametrize(("replicas", "layout"), [
    (2, SliceLayout(1, 2)),
    (4, SliceLayout(2, 2)),
    (6, SliceLayout(3, 2)),
    (3, None),  # a slice and a half
])
def test_replicas_are_whole_slices_of_the_topology(replicas, layout):
    assert layout_for(V5E_2X4, replicas) == layout


def test_gpu_jobs_have_no_slices():
    gpu = AcceleratorSpec(kind="nvidia-gpu", type="nvidia-h100-80gb", count=8)
    assert layout_for(gpu, 4) is None


@pytest.mark.parametrize(("rank", "worker", "slice_id", "hosts"), [
    (0, "0", "0", "j-a3-0.j,j-a3-1.j"),
    (1, "1", "0", "j-a3-0.j,j-a3-1.j"),
    (2, "0", "1", "j-a3-2.j,j-a3-3.j"),
    (3, "1", "1", "j-a3-2.j,j-a3-3.j"),
])
def test_each_host_gets_its_slice_and_the_megascale_variables(rank, worker, slice_id, hosts):
    env = tpu_environment("j", 3, SliceLayout(2, 2), rank)
    assert env == {
        "TPU_WORKER_ID": worker,
        "TPU_WORKER_HOSTNAMES": hosts,
        "MEGASCALE_COORDINATOR_ADDRESS": "j-a3-0.j:8081",
        "MEGASCALE_NUM_SLICES": "2",
        "MEGASCALE_SLICE_ID": slice_id,
        "MEGASCALE_PORT": "8081",
    }


def test_one_slice_gets_no_megascale_variables():
    assert tpu_environment("j", 1, SliceLayout(1, 2), 1) == {
        "TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "j-a1-0.j,j-a1-1.j"}


def _multislice_job(replicas: int) -> dict:
    doc = copy.deepcopy(load_yaml(EXAMPLES / "gke-tpu-v5e.yaml"))
    doc["spec"]["replicas"] = replicas
    return doc


def test_a_two_slice_gang_renders_two_exclusive_slices_with_their_env():
    spec = parse_trainingjob(_multislice_job(4)).spec
    gang = build_gang(JobRef("gpt", "ml", "u"), spec, GangLaunch(2, 4, "latest"))
    labels = [p["metadata"]["labels"][slice_placement.SLICE_LABEL] for p in gang]
    assert labels == ["gpt-a2-s0", "gpt-a2-s0", "gpt-a2-s1", "gpt-a2-s1"]
    envs = [pod_env(p) for p in gang]
    assert [e["MEGASCALE_SLICE_ID"] for e in envs] == ["0", "0", "1", "1"]
    assert [e["TPU_WORKER_ID"] for e in envs] == ["0", "1", "0", "1"]
    assert {e["MEGASCALE_COORDINATOR_ADDRESS"] for e in envs} == {"gpt-a2-0.gpt:8081"}


def test_hosts_that_are_not_whole_slices_are_refused_naming_the_field_and_the_fix():
    with pytest.raises(InvalidTrainingJob) as err:
        parse_trainingjob(_multislice_job(3))
    assert "spec.replicas" in str(err.value)
    assert "set spec.replicas to a multiple of that" in str(err.value)


def test_worker_hostnames_of_the_largest_slices_fit_one_environment_string():
    # tpu7x: 9216 chips, 4 a host; v5p: 8960 chips. A short job name fits, a long one is told
    # how short it must be.
    largest = 9216 // 4
    assert tpu_layout.hostnames_too_long("llm", largest, 2 * largest) is None
    assert tpu_layout.hostnames_bytes("llm", largest, 2 * largest) <= tpu_layout.MAX_ARG_STRLEN
    why = tpu_layout.hostnames_too_long("a" * 45, largest, 2 * largest)
    assert why is not None and "shorten metadata.name to at most" in why
    limit = int(why.rsplit("at most ", 1)[1].split()[0])
    assert tpu_layout.hostnames_too_long("a" * limit, largest, 2 * largest) is None
    assert tpu_layout.hostnames_too_long("a" * (limit + 1), largest, 2 * largest) is not None
    # A v5e slice (64 hosts at most) never comes near it.
    assert tpu_layout.hostnames_too_long("a" * 45, 64, 4096) is None


def test_the_operator_checks_the_job_name_at_the_jobs_largest_size():
    spec = parse_trainingjob(_multislice_job(4)).spec
    assert tpu_layout.job_name_error("gpt", spec) is None
    big = spec.model_copy(update={"accelerator": AcceleratorSpec(
        kind="tpu", type="tpu7x", topology="16x16x36", count=4)})
    assert tpu_layout.job_name_error("a" * 45, big) is not None
    gpu = parse_trainingjob(load_yaml(EXAMPLES / "gke-gpu-spot.yaml")).spec
    assert tpu_layout.job_name_error("a" * 45, gpu) is None
