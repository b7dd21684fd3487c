"""A recovery split into phases from rank 0's log (the goodput bench's phase table)."""

from __future__ import annotations

from tardigrade_local.goodput import Disruption
from tardigrade_local.recovery_phases import median_phases, recovery_phases, step_cache_results

T0 = 1_000_000.0


def recovery(t0: float, hit: int = 1, startup_extra: dict | None = None) -> list[dict]:
    """Attempt `hit` noticed 0.5 s after the disruption at `t0`, saved at +1.5, exited at
    +1.7; attempt `hit + 1` started at +3 and trained its first step at +9."""
    nxt = hit + 1
    return [
        {"event": "step", "attempt": hit, "step": 10, "time": t0 - 0.1},
        {"event": "preempted", "attempt": hit, "step": 11, "time": t0 + 1.5,
         "seconds_since_notice": 1.0},
        {"event": "restart_in_place", "attempt": hit, "time": t0 + 1.7},
        {"event": "startup", "attempt": nxt, "time": t0 + 5.5, "process_started": t0 + 3.0,
         "imports_done": t0 + 4.5, "rendezvous_started": t0 + 4.6, "rendezvous_done": t0 + 5.2,
         "distributed_initialized": t0 + 5.4, **(startup_extra or {})},
        {"event": "restore_done", "attempt": nxt, "step": 11, "time": t0 + 6.0},
        {"event": "compiled", "attempt": nxt, "step": 12, "time": t0 + 8.0},
        {"event": "step", "attempt": nxt, "step": 12, "time": t0 + 9.0},
        {"event": "step", "attempt": nxt, "step": 13, "time": t0 + 9.1},
    ]


def test_each_phase_in_seconds_since_the_disruption():
    phases = recovery_phases(recovery(T0), Disruption("preemption", T0, 1))
    assert phases == {"noticed": 0.5, "saved": 1.5, "exited": 1.7, "process_started": 3.0,
                      "imports_done": 4.5, "rendezvous_started": 4.6, "rendezvous_done": 5.2,
                      "distributed_initialized": 5.4, "restored": 6.0, "compiled": 8.0,
                      "first_step": 9.0}


def test_the_next_gang_is_the_first_later_attempt_and_earlier_lines_do_not_count():
    records = recovery(T0) + recovery(T0 + 100, hit=2)
    second = recovery_phases(records, Disruption("preemption", T0 + 100, 2))
    assert second["first_step"] == 9.0 and second["process_started"] == 3.0
    # The first recovery's next gang is attempt 2, not 3.
    assert recovery_phases(records, Disruption("preemption", T0, 1))["first_step"] == 9.0


def test_a_rank_killed_without_notice_has_no_save_phases():
    records = [r for r in recovery(T0) if r["event"] not in ("preempted", "restart_in_place")]
    phases = recovery_phases(records, Disruption("preemption", T0, 1))
    assert "noticed" not in phases and "saved" not in phases and "exited" not in phases
    assert phases["first_step"] == 9.0


def test_median_per_phase_over_the_recoveries_that_show_it():
    split = [{"saved": 1.0, "first_step": 8.0}, {"first_step": 10.0},
             {"saved": 3.0, "first_step": 12.0}]
    assert median_phases(split) == {"saved": 2.0, "first_step": 10.0}


def test_how_each_rank_of_the_next_gang_got_its_step():
    records = recovery(T0)
    compiled = next(r for r in records if r["event"] == "compiled")
    compiled["step_cache_ranks"] = ["jax_cache 0.310", "hit 0.081"]
    # An earlier gang's line does not count.
    records.insert(0, {"event": "compiled", "attempt": 1, "step": 1, "time": T0 - 50,
                       "step_cache_ranks": ["miss 3.1", "miss 3.0"]})
    assert step_cache_results(records, Disruption("preemption", T0, 1)) == ["jax_cache", "hit"]
    assert step_cache_results(recovery(T0), Disruption("preemption", T0, 1)) == []
    assert step_cache_results(records, Disruption("preemption", T0 + 100, 2)) == []
