"""The node lifecycle controller's and taint eviction's decisions, without a cluster."""

from __future__ import annotations

import pytest
from tardigrade_local.kubelet import nodelifecycle as nl

ADDED = "2026-12-03T07:00:00Z"
T = nl._epoch(ADDED)
UNREACHABLE = {"key": nl.TAINT_UNREACHABLE, "effect": "NoExecute", "timeAdded": ADDED}


def pod(*tolerations: dict) -> dict:
    return {"spec": {"tolerations": list(tolerations)}}


@pytest.mark.parametrize(
    ("tolerations", "due"),
    [
        ((), T),  # not tolerated: deleted at once
        (({"key": nl.TAINT_UNREACHABLE, "operator": "Exists", "effect": "NoExecute",
           "tolerationSeconds": 300},), T + 300),  # DefaultTolerationSeconds
        (({"key": nl.TAINT_UNREACHABLE, "operator": "Exists", "effect": "NoExecute"},), None),
        (({"operator": "Exists"},), None),  # tolerates everything, forever
        (({"key": nl.TAINT_UNREACHABLE, "operator": "Exists", "tolerationSeconds": 30},
          {"operator": "Exists", "tolerationSeconds": 10}), T + 10),  # the smallest wins
        (({"key": nl.TAINT_NOT_READY, "operator": "Exists", "effect": "NoExecute",
           "tolerationSeconds": 300},), T),  # another taint's toleration does not count
        (({"key": nl.TAINT_UNREACHABLE, "operator": "Exists", "effect": "NoSchedule",
           "tolerationSeconds": 300},), T),  # another effect neither
    ],
)
def test_eviction_time(tolerations, due):
    assert nl.eviction_time(pod(*tolerations), [UNREACHABLE]) == due


def test_no_execute_taints_only_evict():
    assert nl.eviction_time(pod(), [{**UNREACHABLE, "effect": "NoSchedule"}]) is None


def test_unknown_conditions_keep_heartbeat_and_move_transition():
    conditions = [
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ok",
         "lastHeartbeatTime": ADDED, "lastTransitionTime": ADDED},
        {"type": "MemoryPressure", "status": "Unknown", "reason": nl.NODE_STATUS_UNKNOWN,
         "lastHeartbeatTime": ADDED, "lastTransitionTime": ADDED},
    ]
    now = "2026-12-03T07:01:00Z"
    ready, memory = nl.unknown_conditions(conditions, now)
    assert (ready["status"], ready["reason"], ready["message"]) == (
        "Unknown", "NodeStatusUnknown", "Kubelet stopped posting node status.")
    assert (ready["lastHeartbeatTime"], ready["lastTransitionTime"]) == (ADDED, now)
    assert memory["lastTransitionTime"] == ADDED  # already Unknown: no transition


def test_unreachable_taints_added_once_and_removed_alone():
    other = {"key": "nvidia.com/gpu", "effect": "NoSchedule"}
    tainted = nl.unreachable_taints([other], ADDED)
    assert [(t["key"], t["effect"]) for t in tainted] == [
        ("nvidia.com/gpu", "NoSchedule"), (nl.TAINT_UNREACHABLE, "NoExecute"),
        (nl.TAINT_UNREACHABLE, "NoSchedule")]
    assert nl.unreachable_taints(tainted, "later") == tainted
    assert nl.without_unreachable(tainted) == [other]
