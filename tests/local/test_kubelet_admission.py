"""Kubelet admission, pure: the reason and message upstream's kubelet writes on a refusal."""

from __future__ import annotations

from typing import Any

import pytest
from tardigrade_local.kubelet.admission import admit, holds_resources


def pod(requests: dict[str, str], init: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main", "resources": {"requests": requests}}]}
    if init:
        spec["initContainers"] = [{"name": "init", "resources": {"requests": init}}]
    return {"metadata": {"name": "p"}, "spec": spec}


NODE = {"cpu": "4", "memory": "16Gi", "pods": "3", "nvidia.com/gpu": "8"}


@pytest.mark.parametrize(("requests", "admitted", "reason", "message"), [
    ({"nvidia.com/gpu": "8"}, [{"nvidia.com/gpu": "1"}], "OutOfnvidia.com/gpu",
     "Node didn't have enough resource: nvidia.com/gpu, requested: 8, used: 1, capacity: 8"),
    # CPU in millicores, as the scheduler's Resource counts it.
    ({"cpu": "1500m"}, [{"cpu": "3"}], "OutOfcpu",
     "Node didn't have enough resource: cpu, requested: 1500, used: 3000, capacity: 4000"),
    ({"memory": "8Gi"}, [{"memory": "9Gi"}], "OutOfmemory",
     "Node didn't have enough resource: memory, requested: 8589934592, used: 9663676416, "
     "capacity: 17179869184"),
    ({}, [{}, {}, {}], "OutOfpods",
     "Node didn't have enough resource: pods, requested: 1, used: 3, capacity: 3"),
    # The node lists none of it: 0 allocatable of a native resource is still checked.
    ({"ephemeral-storage": "1Gi"}, [], "OutOfephemeral-storage",
     "Node didn't have enough resource: ephemeral-storage, requested: 1073741824, used: 0, "
     "capacity: 0"),
])
def test_a_pod_over_what_the_node_has_left_is_rejected(requests, admitted, reason, message):
    rejection = admit(pod(requests), NODE, [pod(r) for r in admitted])
    assert rejection is not None
    assert (rejection.reason, rejection.message) == (reason, message)
    assert rejection.pod_status() == {"phase": "Failed", "reason": reason,
                                      "message": "Pod was rejected: " + message}


def test_a_pod_that_fits_is_admitted():
    assert admit(pod({"nvidia.com/gpu": "4", "cpu": "1"}), NODE,
                 [pod({"nvidia.com/gpu": "4", "cpu": "3"})]) is None


def test_an_extended_resource_the_node_does_not_list_is_not_the_kubelets_to_check():
    # removeMissingExtendedResources (cluster-level and DRA-backed extended resources).
    assert admit(pod({"google.com/tpu": "4"}), NODE, []) is None


def test_the_largest_init_container_counts_when_it_exceeds_the_containers():
    rejection = admit(pod({"nvidia.com/gpu": "1"}, init={"nvidia.com/gpu": "9"}), NODE, [])
    assert rejection is not None and rejection.reason == "OutOfnvidia.com/gpu"


@pytest.mark.parametrize(("phase", "termination_requested", "terminated", "holds"), [
    ("Pending", False, False, True),
    ("Running", False, False, True),
    ("Running", True, False, True),  # stopping inside its grace period
    # Reported Failed/Succeeded: the scheduler has already dropped it, so must the kubelet.
    ("Failed", False, False, False),
    ("Succeeded", False, False, False),
    ("Failed", True, False, True),  # deleted while its containers are still being killed
    ("Running", True, True, False),  # its worker has finished terminating
])
def test_a_pod_holds_its_resources_until_the_kubelet_calls_it_terminal(
        phase, termination_requested, terminated, holds):
    assert holds_resources(phase, termination_requested=termination_requested,
                           terminated=terminated) is holds
