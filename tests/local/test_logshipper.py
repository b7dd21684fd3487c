"""The log shipper writes what the API serves in the kubelet's CRI format, so the readers of
the kubelets' files read it as the container wrote it."""

from __future__ import annotations

import json
from pathlib import Path

from tardigrade_local.kubelet import crilog
from tardigrade_local.logshipper import cri_line
from tardigrade_local.steplog import StepLog


def test_shipped_lines_read_back_as_written() -> None:
    lines = ['{"event": "step", "step": 1, "loss": 2.5}', "", "a line with  spaces ",
             "ünïcode"]
    shipped = "".join(cri_line(f"2026-12-07T02:40:00.{i:09d}Z {line}")
                      for i, line in enumerate(lines))
    assert crilog.text(shipped.encode()).splitlines() == lines


def test_a_step_log_reads_shipped_files(tmp_path: Path) -> None:
    run = tmp_path / "default_j-a2-0_uid-1" / "trainer" / "0.log"
    run.parent.mkdir(parents=True)
    records = [{"event": "checkpoint_restored", "step": 4},
               {"event": "step", "step": 5, "loss": 1.25}]
    run.write_text("".join(cri_line(f"2026-12-07T02:40:00Z {json.dumps(r)}") for r in records))
    log = StepLog.from_pod_log_dirs([tmp_path], "default", "j")
    assert log.losses == {5: [1.25]}
    assert log.restored == [4]
