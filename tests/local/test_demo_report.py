"""The demo's picture and report, from a job's recorded recoveries: no cluster needed."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from tardigrade_local.demo_report import (
    MARKER_COLORS,
    Marker,
    plot_losses,
    recovery_markers,
    write_table,
)

# What the operator records for the demo's story: a spot reclaim whose save on notice the gang
# resumed from, then a resize from 2 to 3 replicas (status.recoveries, as the API returns it).
RECOVERIES = [
    {"cause": "Preemption", "time": "2026-12-06T10:00:00Z", "attempt": 2, "fromReplicas": 2,
     "toReplicas": 2, "restoreStep": 40, "stepsLost": 0, "downtimeSeconds": 3.1},
    {"cause": "Resize", "time": "2026-12-06T10:01:00Z", "attempt": 3, "fromReplicas": 2,
     "toReplicas": 3, "restoreStep": 67, "stepsLost": 0, "downtimeSeconds": 4.2},
]


def test_markers_sit_at_the_steps_the_gang_saved_at():
    markers = recovery_markers(RECOVERIES)
    assert [(m.step, m.cause) for m in markers] == [(40, "Preemption"), (67, "Resize")]
    assert [m.label for m in markers] == ["preemption save at step 40",
                                         "resize 2 -> 3 at step 67"]


def test_a_recovery_that_lost_steps_says_where_it_stopped_and_resumed():
    lost = {"cause": "Preemption", "attempt": 2, "restoreStep": 25, "stepsLost": 9}
    [marker] = recovery_markers([lost])
    assert marker.step == 25
    assert marker.label == "preemption at step 34, resumed from step 25 (9 steps lost)"


def test_a_recovery_without_a_checkpoint_restarts_from_step_zero():
    [marker] = recovery_markers([{"cause": "Failure", "attempt": 2, "restoreStep": None}])
    assert (marker.step, marker.label) == (0, "failure: no checkpoint, restarted from step 0")


@pytest.mark.parametrize(("recovery", "field"), [
    ({"attempt": 2, "restoreStep": 4}, "status.recoveries[0].cause"),
    ({"cause": "Preemption", "restoreStep": "40"}, "status.recoveries[0].restoreStep"),
    ({"cause": "Preemption", "restoreStep": -1}, "status.recoveries[0].restoreStep"),
    ({"cause": "Preemption", "restoreStep": 4, "stepsLost": True},
     "status.recoveries[0].stepsLost"),
])
def test_a_malformed_record_names_its_field(recovery, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        recovery_markers([recovery])


def _pixels_of(color: str, pixels: np.ndarray) -> int:
    from matplotlib.colors import to_rgb

    rgb = np.array([round(c * 255) for c in to_rgb(color)])
    return int((np.abs(pixels[:, :, :3].astype(int) - rgb).sum(axis=2) < 30).sum())


def test_the_picture_draws_and_describes_the_recorded_markers(tmp_path):
    curve = {step: 4.0 - step / 50 for step in range(1, 91)}
    markers = recovery_markers(RECOVERIES)
    path = plot_losses(curve, dict(curve), markers, tmp_path / "demo.png")
    image = Image.open(path)
    description = json.loads(image.info["Description"])
    assert description["markers"] == [{"step": 40, "label": "preemption save at step 40"},
                                      {"step": 67, "label": "resize 2 -> 3 at step 67"}]
    pixels = np.asarray(image.convert("RGB"))
    for cause in ("Preemption", "Resize"):
        assert _pixels_of(MARKER_COLORS[cause], pixels) > 50, f"{cause} marker not drawn"


def test_the_report_states_the_same_steps_as_the_picture(tmp_path):
    job = {"status": {"phase": "Succeeded", "replicas": 3, "recoveries": RECOVERIES,
                      "restarts": {"preemptions": 1, "resizes": 1}}}
    curve = {step: 1.0 for step in range(1, 91)}
    markers = [*recovery_markers(RECOVERIES), Marker(5, "drawn by hand")]
    table = write_table(job, {}, curve, curve, markers, tmp_path / "demo.md").read_text()
    assert "| 2 | Preemption | 2 | 40 | 0 | 3.1 |" in table
    assert "| 3 | Resize | 3 | 67 | 0 | 4.2 |" in table
    marked = [line for line in table.splitlines() if line.startswith("- marked on the curve: ")]
    assert marked == [f"- marked on the curve: {m.label}" for m in markers]


def test_the_report_says_where_the_wall_time_went(tmp_path):
    seconds = {"queued": 12.0, "podStart": 3.0, "acceleratorStart": 6.0, "restore": 2.0,
               "compile": 4.0, "checkpointStall": 1.0, "lostSteps": 0.0, "productive": 60.0,
               "other": 12.0}
    job = {"status": {"phase": "Succeeded", "recoveries": RECOVERIES, "goodput": {
        "wallSeconds": 100.0, "fraction": 0.6, "seconds": seconds}}}
    curve = {step: 1.0 for step in range(1, 91)}
    table = write_table(job, {}, curve, curve, [], tmp_path / "demo.md").read_text()
    assert "Goodput: 60.0% of 100.0 s wall time" in table
    rows = [line for line in table.splitlines() if line.startswith("| ")
            and line.split(" | ")[0][2:] in seconds]
    assert rows[0] == "| queued | 12.0 | 12.0% |" and rows[-1] == "| other | 12.0 | 12.0% |"
    assert len(rows) == len(seconds)
    job["status"]["goodput"]["seconds"]["other"] = "lots"
    with pytest.raises(ValueError, match=r"status\.goodput\.seconds\.other"):
        write_table(job, {}, curve, curve, [], tmp_path / "demo.md")
    del job["status"]["goodput"]
    assert "- goodput: no account recorded" in write_table(
        job, {}, curve, curve, [], tmp_path / "demo.md").read_text()
