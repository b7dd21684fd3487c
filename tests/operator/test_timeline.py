"""The recovery timeline shown to users."""

from __future__ import annotations

from rich.console import Console
from tardigrade_operator.cli.timeline import render


def _text(job):
    console = Console(width=160, record=True)
    console.print(render(job))
    return console.export_text()


def test_timeline_shows_each_recovery_and_totals():
    job = {
        "metadata": {"name": "tiny"},
        "status": {
            "phase": "Running", "attempt": 3, "replicas": 3, "step": 120, "totalSteps": 200,
            "lastCheckpoint": {"step": 100, "path": "gs://b/tiny/100"},
            "restarts": {"preemptions": 1, "resizes": 1, "total": 2},
            "recoveries": [
                {"cause": "Preemption", "time": "2026-12-02T12:00:05Z", "attempt": 2,
                 "fromReplicas": 2, "toReplicas": 2, "restoreStep": 41, "stepsLost": 0,
                 "downtimeSeconds": 12.5, "reason": "tiny-a1-1: TerminationByKubelet"},
                {"cause": "Resize", "time": "2026-12-02T12:03:00Z", "attempt": 3,
                 "fromReplicas": 2, "toReplicas": 3, "restoreStep": 90, "stepsLost": 2,
                 "reason": "spec.replicas changed from 2 to 3"},
            ],
        },
    }
    text = _text(job)
    assert "tiny: Running, attempt 3, 3 replicas, step 120/200" in text
    assert "1 preemptions, 0 failures, 1 resizes" in text
    assert "steps lost: 2, downtime: 12.5s" in text
    assert "TerminationByKubelet" in text
    assert "2 -> 3" in text
    assert "12.5s" in text


def test_timeline_of_a_fresh_job():
    text = _text({"metadata": {"name": "new"}})
    assert "new: Pending, attempt 0" in text
    assert "last checkpoint: -" in text
