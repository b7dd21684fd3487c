"""`tardigrade demo --quick`, as a user runs it (as root): the story on real nodes (real
kubelets and containerd, the chart's operator, checkpoints on the GCS emulator), checked by
what it leaves behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from tests.conftest import REPO_ROOT, SOURCE_DIRS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                       reason="real nodes need Linux and root (namespaces, mounts, cgroups)"),
]

STEPS = 90


def _has_color(pixels: np.ndarray, rgb: tuple[int, int, int], tolerance: int = 30) -> bool:
    distance = np.abs(pixels[:, :, :3].astype(int) - np.array(rgb)).sum(axis=2)
    return int((distance < tolerance).sum()) > 50


def test_demo_tells_the_story_on_real_nodes_with_gcs_checkpoints(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in SOURCE_DIRS)}
    result = subprocess.run(
        [sys.executable, "-m", "tardigrade_operator.cli", "demo", "--quick", "--out",
         str(tmp_path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Preempting node real-" in result.stdout
    assert "kubectl scale trainingjob/tiny-gpt --replicas=3" in result.stdout

    summary = json.loads((tmp_path / "tardigrade-demo.json").read_text())
    status = summary["job"]
    assert status["phase"] == "Succeeded"
    assert status["step"] == STEPS
    assert [r["cause"] for r in status["recoveries"]] == ["Preemption", "Resize"]
    assert all(r["stepsLost"] == 0 for r in status["recoveries"])
    assert status["restarts"]["failures"] == 0
    # The gang checkpointed to the emulator's bucket from the real nodes' pods: the last
    # commit the operator reported is there (read on the host before the cluster stopped).
    checkpoints = summary["checkpoints"]
    assert checkpoints["path"] == "gs://tardigrade/checkpoints/tiny-gpt"
    assert status["lastCheckpoint"]["step"] in checkpoints["committed"]
    losses = {int(k): v for k, v in summary["losses"].items()}
    reference = {int(k): v for k, v in summary["reference_losses"].items()}
    assert sorted(losses) == list(range(1, STEPS + 1)) == sorted(reference)
    # Same data and state: the curves agree up to float reduction order across mesh shapes.
    assert max(abs(losses[s] - reference[s]) for s in losses) < 1e-3

    table = (tmp_path / "tardigrade-demo.md").read_text()
    assert "| 2 | Preemption | 2 |" in table
    assert "| 3 | Resize | 3 |" in table
    assert f"- final step: {STEPS} (phase Succeeded)" in table
    assert "- steps lost in total: 0" in table
    # The markers sit where the gang saved and resumed, as the operator recorded it.
    preempted, resized = (r["restoreStep"] for r in status["recoveries"])
    assert f"- marked on the curve: preemption save at step {preempted}" in table
    assert f"- marked on the curve: resize 2 -> 3 at step {resized}" in table

    image = Image.open(tmp_path / "tardigrade-demo.png")
    description = json.loads(image.info["Description"])
    assert description["final_step"] == STEPS
    assert [m["step"] for m in description["markers"]] == [preempted, resized]
    assert [m["label"].split()[0] for m in description["markers"]] == ["preemption", "resize"]
    pixels = np.asarray(image.convert("RGB"))
    assert _has_color(pixels, (214, 39, 40)), "preemption marker (red) missing"
    assert _has_color(pixels, (255, 127, 14)), "resize marker (orange) missing"
    assert _has_color(pixels, (31, 119, 180)), "loss curve (blue) missing"
    # The demo cleans up after itself: nothing left beside its outputs.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "tardigrade-demo.json", "tardigrade-demo.md", "tardigrade-demo.png"]
    assert REPO_ROOT.exists()
