"""The recovery timeline shown to users."""

from __future__ import annotations

from rich.console import Console
from tardigrade_operator.cli.timeline import BUCKET_LABELS, as_json, render


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


def test_timeline_shows_the_goodput_account_by_bucket():
    job = {"metadata": {"name": "tiny"}, "status": {"phase": "Running", "goodput": {
        "wallSeconds": 200.0, "fraction": 0.6, "accountedUntil": "2026-12-02T12:03:20Z",
        "seconds": {"queued": 30.0, "podStart": 10.0, "acceleratorStart": 8.0,
                    "restore": 4.0, "compile": 6.0, "checkpointStall": 2.0,
                    "lostSteps": 12.0, "productive": 120.0, "other": 8.0}}}}
    text = _text(job)
    assert "goodput 60.0% of 200.0s wall time (to 12:03:20)" in text
    cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in text.splitlines()
             if line.startswith("│")]
    rows = {row[0]: row[1:3] for row in cells if row and row[0] in BUCKET_LABELS}
    assert rows["productive"] == ["120.0", "60.0%"]
    assert rows["lostSteps"] == ["12.0", "6.0%"]
    assert list(rows) == list(BUCKET_LABELS)
    assert as_json(job)["goodput"]["seconds"]["queued"] == 30.0
    assert "goodput: no account yet" in _text({"metadata": {"name": "new"}})
