"""Observation: how one pod's status becomes a rank's outcome."""

from __future__ import annotations

from typing import Any

import pytest
from tardigrade_contract import contract
from tardigrade_operator.observation.pods import Outcome, classify, newest_readiness, parse_pod


def test_a_deleted_node_seen_last_as_not_ready_does_not_shadow_its_replacement():
    # (resourceVersion, ready): the reclaimed VM's last state, then its replacement.
    index = [("node-a", [(120, False), (180, True)]), ("node-b", [(90, True)]),
             ("node-c", [(200, False), (150, True)])]
    assert newest_readiness(index) == {"node-a": True, "node-b": True, "node-c": False}


def pod(status: dict[str, Any], retryable: tuple[int, ...] = ()) -> Any:
    view = parse_pod({
        "metadata": {"name": "tiny-a1-0",
                     "labels": {"tardigrade.dev/attempt": "1", "tardigrade.dev/rank": "0"}},
        "spec": {"nodeName": "node-0"},
        "status": status,
    })
    assert view is not None
    return classify(view, retryable)


def terminated(name: str, code: int, message: str = "") -> dict[str, Any]:
    return {"name": name, "state": {"terminated": {
        "exitCode": code, "reason": "Completed" if code == 0 else "Error", "message": message}}}


RUNNING_SIDECAR = {"name": "log-shipper", "state": {"running": {}}}


# (pod.status.reason, pod.status.message) as the kubelet's rejectPod writes them
# (pkg/kubelet/kubelet.go: phase Failed, "Pod was rejected: " + the admit handler's message).
@pytest.mark.parametrize(("reason", "message"), [
    ("OutOfnvidia.com/gpu", "Node didn't have enough resource: nvidia.com/gpu, requested: 8, "
                            "used: 8, capacity: 8"),
    ("OutOfgoogle.com/tpu", "Node didn't have enough resource: google.com/tpu, requested: 4, "
                            "used: 4, capacity: 4"),
    ("OutOfcpu", "Node didn't have enough resource: cpu, requested: 4000, used: 2000, "
                 "capacity: 4000"),
    ("OutOfpods", "Node didn't have enough resource: pods, requested: 1, used: 110, "
                  "capacity: 110"),
    # The device plugin is not registered yet (predicate.go, pluginResourceUpdateFunc).
    ("UnexpectedAdmissionError", "Update plugin resources failed due to requested number of "
                                 "devices unavailable for nvidia.com/gpu. Requested: 8, "
                                 "Available: 0, which is unexpected."),
    ("NodeAffinity", "Predicate NodeAffinity failed: node(s) didn't match Pod's node affinity"),
    ("TaintToleration", "Predicate TaintToleration failed: node(s) had untolerated taint"),
    ("NodeShutdown", "Pod was rejected as the node is shutting down."),
    ("Evicted", "The node had condition: [MemoryPressure]. "),
    ("TopologyAffinityError", "Resources cannot be allocated with Topology locality"),
    ("SysctlForbidden", "forbidden sysctl: \"net.core.somaxconn\" not allowlisted"),
    ("PodOSNotSupported", "Failed to admit pod as the OS field doesn't match node OS"),
])
def test_kubelet_admission_rejections_are_placement_problems(reason, message):
    outcome = pod({"phase": "Failed", "reason": reason, "message": f"Pod was rejected: {message}"})
    assert outcome.outcome is Outcome.REJECTED
    assert outcome.reason == f"tiny-a1-0: {reason}: Pod was rejected: {message}"


def test_a_pod_pushed_off_its_node_after_it_ran_is_preempted_not_rejected():
    # Evicted under node pressure, or re-admitted (and refused) after a kubelet restart.
    for reason in ("Evicted", "OutOfcpu", "NodeShutdown"):
        outcome = pod({"phase": "Failed", "reason": reason,
                       "containerStatuses": [terminated("trainer", 137)]})
        assert outcome.outcome is Outcome.PREEMPTED, reason


def test_other_failed_pod_reasons_are_not_admission_rejections():
    outcome = pod({"phase": "Failed", "reason": "DeadlineExceeded",
                   "containerStatuses": [terminated("trainer", 137)]})
    assert outcome.outcome is Outcome.FAILED


# A regular (non-native) sidecar keeps the pod Running after the trainer exits: the trainer
# container's exit code and termination message decide, whatever the pod phase.
@pytest.mark.parametrize(("code", "phase", "expected"), [
    (0, "Running", Outcome.SUCCEEDED),
    (1, "Running", Outcome.FAILED),
    (contract.EXIT_CONFIG_ERROR, "Running", Outcome.FATAL),
    (contract.EXIT_PREEMPTED_SAVED, "Running", Outcome.PREEMPTED),
    (contract.EXIT_PEER_TIMEOUT, "Running", Outcome.RETRYABLE),
    (137, "Running", Outcome.RETRYABLE),  # marked retryable in the spec
    # The trainer finished, the sidecar then failed: the pod is Failed, the rank is done.
    (0, "Failed", Outcome.SUCCEEDED),
])
def test_the_trainer_container_decides_not_the_pod_phase(code, phase, expected):
    statuses = [RUNNING_SIDECAR if phase == "Running" else terminated("log-shipper", 2),
                terminated("trainer", code, "Traceback...\nValueError: boom")]
    outcome = pod({"phase": phase, "containerStatuses": statuses}, retryable=(137,))
    assert outcome.outcome is expected
    if expected is Outcome.FAILED:
        assert "exited with code 1" in outcome.reason and "ValueError: boom" in outcome.reason


def test_a_running_sidecar_does_not_make_a_running_trainer_look_finished():
    statuses = [terminated("log-shipper", 0), {"name": "trainer", "state": {"running": {}}}]
    assert pod({"phase": "Running", "containerStatuses": statuses}).outcome is Outcome.RUNNING


def test_native_sidecars_are_init_containers_and_never_read_as_the_trainer():
    # restartPolicy Always init containers (KEP-753): still running when the trainer exits;
    # the pod completes without them.
    outcome = pod({"phase": "Failed",
                   "initContainerStatuses": [{"name": "proxy", "state": {"running": {}}}],
                   "containerStatuses": [terminated("trainer", 1, "boom")]})
    assert outcome.outcome is Outcome.FAILED
