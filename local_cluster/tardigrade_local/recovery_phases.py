"""A recovery split into phases, from rank 0's own log: where the time to recover goes.

The hit gang's side: its notice (`preempted`: `seconds_since_notice` before the line), the save
committed (that line) and the last line before it exited. The next gang's side: its trainer's
`startup` line (tardigrade_sdk/phases.py: process start, imports, rendezvous begun and met,
`jax.distributed` initialized), `restore_done`, `compiled` and its first `step`. Each phase is
given in seconds since the disruption; a phase the log does not show is left out (a rank
killed without notice never logs `preempted`). Pure, over `StepLog.records`.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tardigrade_local.goodput import Disruption

# In the order a recovery goes through them.
PHASES = ("noticed", "saved", "exited", "process_started", "imports_done",
          "rendezvous_started", "rendezvous_done", "distributed_initialized", "restored",
          "compiled", "first_step")
_STARTUP = ("process_started", "imports_done", "rendezvous_started", "rendezvous_done",
            "distributed_initialized")


def _first(records: Iterable[Mapping[str, Any]], event: str) -> Mapping[str, Any] | None:
    return min((r for r in records if r.get("event") == event),
               key=lambda r: float(r["time"]), default=None)


def recovery_phases(records: Sequence[Mapping[str, Any]],
                    disruption: Disruption) -> dict[str, float]:
    """Seconds from `disruption` to each phase of its recovery (see PHASES)."""
    hit = [r for r in records if int(r["attempt"]) == disruption.attempt
           and float(r["time"]) >= disruption.time]
    later = sorted({int(r["attempt"]) for r in records if int(r["attempt"]) > disruption.attempt})
    times: dict[str, float] = {}
    preempted = _first(hit, "preempted")
    if preempted is not None:
        times["saved"] = float(preempted["time"])
        times["noticed"] = float(preempted["time"]) - float(preempted["seconds_since_notice"])
    if hit:
        times["exited"] = max(float(r["time"]) for r in hit)
    if later:
        nxt = [r for r in records if int(r["attempt"]) == later[0]]
        startup = _first(nxt, "startup") or {}
        times.update({name: float(startup[name]) for name in _STARTUP if name in startup})
        for name, event in (("restored", "restore_done"), ("compiled", "compiled"),
                            ("first_step", "step")):
            record = _first(nxt, event)
            if record is not None:
                times[name] = float(record["time"])
    return {name: round(times[name] - disruption.time, 2) for name in PHASES if name in times}


def step_cache_results(records: Sequence[Mapping[str, Any]],
                       disruption: Disruption) -> list[str]:
    """How each rank of the next gang got its compiled step, in rank order: the first word of
    each of rank 0's `compiled` line's `step_cache_ranks` (tardigrade_trainer/step_cache.py:
    hit, miss, jax_cache, fallback, off); empty when the log does not say."""
    later = sorted({int(r["attempt"]) for r in records if int(r["attempt"]) > disruption.attempt})
    if not later:
        return []
    compiled = _first([r for r in records if int(r["attempt"]) == later[0]], "compiled") or {}
    return [str(rank).split()[0] for rank in compiled.get("step_cache_ranks") or []]


def median_phases(split: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per phase, the median over the recoveries that show it."""
    return {name: round(statistics.median(values), 2) for name in PHASES
            if (values := [s[name] for s in split if name in s])}
