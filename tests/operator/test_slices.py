"""Exclusive slice placement: what the operator renders for TPU gangs, and nothing for others."""

from __future__ import annotations

import pytest
from tardigrade_operator.api.parse import parse_trainingjob
from tardigrade_operator.rendering import slice_placement
from tardigrade_operator.rendering.manifests import GangLaunch, JobRef, build_gang

from tests.conftest import EXAMPLES, load_yaml

JOB = JobRef(name="gpt", namespace="ml", uid="0d3c")


def _gang(example: str, attempt: int = 3) -> list[dict]:
    spec = parse_trainingjob(load_yaml(EXAMPLES / example)).spec
    return build_gang(JOB, spec, GangLaunch(attempt, spec.replicas, "latest"))


def test_every_host_of_a_tpu_slice_carries_its_slice_label_and_the_exclusive_terms():
    gang = _gang("gke-tpu-v5e.yaml")
    assert len(gang) == 2
    for pod in gang:
        assert pod["metadata"]["labels"][slice_placement.SLICE_LABEL] == "gpt-a3-s0"
        affinity = pod["spec"]["affinity"]
        (together,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        (alone,) = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert together == {
            "labelSelector": {"matchExpressions": [
                {"key": "tardigrade.dev/slice", "operator": "In", "values": ["gpt-a3-s0"]}]},
            "topologyKey": "cloud.google.com/gke-nodepool", "namespaceSelector": {}}
        assert alone == {
            "labelSelector": {"matchExpressions": [
                {"key": "tardigrade.dev/slice", "operator": "Exists"},
                {"key": "tardigrade.dev/slice", "operator": "NotIn", "values": ["gpt-a3-s0"]}]},
            "topologyKey": "cloud.google.com/gke-nodepool", "namespaceSelector": {}}


# One-host slices of every kind GKE offers (tpu_shapes.py): a VM each.
SINGLE_HOST = [("tpu-v5-lite-podslice", "1x1", 1), ("tpu-v5-lite-podslice", "2x2", 4),
               ("tpu-v5-lite-podslice", "2x4", 8), ("tpu-v5-lite-device", "2x4", 8),
               ("tpu-v6e-slice", "2x4", 8), ("tpu-v4-podslice", "2x2x1", 4),
               ("tpu-v5p-slice", "2x2x1", 4), ("tpu7x", "1x1x1", 1)]


@pytest.mark.parametrize(("kind", "topology", "count"), SINGLE_HOST)
def test_a_single_host_slice_gets_no_exclusive_pool_terms(kind, topology, count):
    doc = load_yaml(EXAMPLES / "gke-tpu-v5e.yaml")
    doc["spec"]["replicas"] = 1
    doc["spec"]["accelerator"] = {"kind": "tpu", "type": kind, "topology": topology,
                                  "count": count}
    spec = parse_trainingjob(doc).spec
    (pod,) = build_gang(JOB, spec, GangLaunch(3, 1, "latest"))
    assert slice_placement.SLICE_LABEL not in pod["metadata"]["labels"]
    affinity = pod["spec"].get("affinity", {})
    assert "podAffinity" not in affinity and "podAntiAffinity" not in affinity
    assert pod["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == topology
    assert pod["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] == str(count)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["TPU_WORKER_ID"] == "0"
    assert env["TPU_WORKER_HOSTNAMES"] == "gpt-a3-0.gpt"
    assert not any(name.startswith("MEGASCALE_") for name in env)
    # Every host is a leader: nothing waits for a leader to be placed.
    assert slice_placement.followers(spec, 1, [0], {}) == []


def test_a_new_attempt_is_a_new_slice_identity():
    assert {p["metadata"]["labels"][slice_placement.SLICE_LABEL]
            for p in _gang("gke-tpu-v5e.yaml", attempt=4)} == {"gpt-a4-s0"}


@pytest.mark.parametrize("example", ["trainingjob.yaml", "gke-gpu-spot.yaml"])
def test_gpu_and_cpu_hosts_are_not_pinned_to_a_pool(example):
    for pod in _gang(example):
        assert slice_placement.SLICE_LABEL not in pod["metadata"]["labels"]
        assert "affinity" not in pod["spec"]


def test_a_follower_keeps_its_node_affinity_and_trades_the_pod_terms_for_the_pool():
    leader, follower = _gang("gke-tpu-v5e.yaml")
    no_maintenance = {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "cloud.google.com/scheduled-maintenance-time", "operator": "DoesNotExist"}]}]}}
    follower["spec"]["affinity"]["nodeAffinity"] = no_maintenance
    pinned = slice_placement.as_follower(follower, "tpu-pool-7")
    assert pinned["spec"]["affinity"] == {"nodeAffinity": no_maintenance}
    assert pinned["spec"]["nodeSelector"] == {**follower["spec"]["nodeSelector"],
                                              slice_placement.NODE_POOL_LABEL: "tpu-pool-7"}
    assert "podAffinity" in follower["spec"]["affinity"]  # the rendered pod is left as it was
    assert "affinity" not in slice_placement.as_follower(leader, "tpu-pool-7")["spec"]
