"""`tardigrade demo --quick --real-nodes`, as a user runs it (as root): the demo's story on real
nodes, with checkpoints on the GCS emulator, checked by what it leaves behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import SOURCE_DIRS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                       reason="real nodes need Linux and root (namespaces, mounts, cgroups)"),
]

STEPS = 90


def test_demo_on_real_nodes_tells_the_story_with_gcs_checkpoints(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in SOURCE_DIRS)}
    result = subprocess.run(
        [sys.executable, "-m", "tardigrade_operator.cli", "demo", "--quick", "--real-nodes",
         "--out", str(tmp_path)], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=1500)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Preempting node real-" in result.stdout
    assert "kubectl scale trainingjob/tiny-gpt --replicas=3" in result.stdout

    summary = json.loads((tmp_path / "tardigrade-demo.json").read_text())
    status = summary["job"]
    assert summary["real_nodes"] is True
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
    assert f"- final step: {STEPS} (phase Succeeded)" in table
    assert "- steps lost in total: 0" in table
    assert (tmp_path / "tardigrade-demo.png").stat().st_size > 0
