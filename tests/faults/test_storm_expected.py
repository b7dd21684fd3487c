"""The preemption storm's expectation (`storm_expected`): what its hits explain, from a status
and the nodes its pods were bound to, without a cluster."""

from __future__ import annotations

from typing import Any

from tests.faults.operator_scenarios import counter_mismatches, storm_expected

# storm-1's pods and their nodes; spot-3 is reclaimed while attempt 2 runs on it, and the
# scheduler places attempt 3's rank 1 on it before its Node says it is shutting down.
BOUND = {"storm-1-a1-0": "spot-1", "storm-1-a1-1": "spot-2",
         "storm-1-a2-0": "spot-1", "storm-1-a2-1": "spot-3",
         "storm-1-a3-0": "spot-2", "storm-1-a3-1": "spot-3",
         "storm-1-a4-0": "spot-1", "storm-1-a4-1": "spot-2"}


def _status(*recoveries: tuple[str, str]) -> dict[str, Any]:
    return {"attempt": len(recoveries) + 1, "replicas": 2,
            "recoveries": [{"attempt": i, "cause": cause, "reason": reason}
                           for i, (cause, reason) in enumerate(recoveries, start=2)],
            "restarts": {"preemptions": sum(c == "Preemption" for c, _ in recoveries),
                         "rejections": sum(c == "NodeRejected" for c, _ in recoveries),
                         "failures": 0, "resizes": 0, "retries": 0,
                         "total": len(recoveries)}}


def test_one_preemption_per_hit_is_all_it_expects_without_a_refusal() -> None:
    status = _status(("Preemption", "storm-1-a1-1: NodeShutdown"),
                     ("Preemption", "storm-1-a2-1: NodeShutdown"))
    expected = storm_expected(status, [("spot-2", 1), ("spot-3", 2)], BOUND.get)
    assert expected.causes == ("Preemption", "Preemption") and expected.attempt == 3
    assert counter_mismatches(status, expected) == []


def test_a_later_rank_refused_by_a_vm_being_reclaimed_is_explained_as_what_it_was() -> None:
    status = _status(("Preemption", "storm-1-a1-1: NodeShutdown"),
                     ("Preemption", "storm-1-a2-1: NodeShutdown"),
                     ("NodeRejected", "storm-1-a3-1: NodeShutdown: Pod was rejected: node is "
                                      "shutting down"))
    expected = storm_expected(status, [("spot-2", 1), ("spot-3", 2)], BOUND.get)
    assert expected.causes == ("Preemption", "Preemption", "NodeRejected")
    assert counter_mismatches(status, expected) == []


def test_a_refusal_where_no_hit_shut_the_vm_down_stays_unexplained() -> None:
    # spot-1 was never reclaimed: its refusal is not the storm's doing.
    status = _status(("Preemption", "storm-1-a1-1: NodeShutdown"),
                     ("Preemption", "storm-1-a2-1: NodeShutdown"),
                     ("NodeRejected", "storm-1-a3-0: NodeShutdown"))
    bound = {**BOUND, "storm-1-a3-0": "spot-1"}
    expected = storm_expected(status, [("spot-2", 1), ("spot-3", 2)], bound.get)
    assert expected.causes == ("Preemption", "Preemption")
    assert any("attempt=4 (want 3)" in m for m in counter_mismatches(status, expected))


def test_a_preemption_no_hit_and_no_refusal_explains_is_a_mismatch() -> None:
    status = _status(("Preemption", "storm-1-a1-1: NodeShutdown"),
                     ("Preemption", "storm-1-a2-1: NodeShutdown"),
                     ("Preemption", "storm-1-a3-0: Evicted"))
    expected = storm_expected(status, [("spot-2", 1), ("spot-3", 2)], BOUND.get)
    assert expected.causes == ("Preemption", "Preemption")
    assert counter_mismatches(status, expected) != []


def test_a_hit_without_a_recovery_is_a_preemption_missed() -> None:
    status = _status(("Preemption", "storm-1-a1-1: NodeShutdown"))
    expected = storm_expected(status, [("spot-2", 1), ("spot-3", 2)], BOUND.get)
    assert expected.causes == ("Preemption", "Preemption")
    assert counter_mismatches(status, expected) != []
