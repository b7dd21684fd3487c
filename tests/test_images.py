"""The Dockerfiles (no Docker engine here): their entry points exist and run, they are
non-root, and the extras they install exist."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import REPO_ROOT, SOURCE_DIRS

DOCKERFILES = [REPO_ROOT / "operator" / "Dockerfile",
               *sorted((REPO_ROOT / "trainer_image").glob("Dockerfile.*"))]
EXTRAS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
    "optional-dependencies"]


def _instruction(text: str, name: str) -> str | None:
    found = re.findall(rf"^{name}\s+(.+)$", text, flags=re.MULTILINE)
    return found[-1].strip() if found else None


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.relative_to(REPO_ROOT).name)
def test_image_runs_as_non_root(dockerfile):
    user = _instruction(dockerfile.read_text(), "USER")
    assert user is not None and user.split(":")[0] not in ("root", "0")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.relative_to(REPO_ROOT).name)
def test_installed_extras_exist(dockerfile):
    # Our own package's extras: ".[trainer]" or "<our wheel>[operator]" (not "jax[tpu]").
    text = dockerfile.read_text()
    ours = re.findall(r'"\.\[([a-z,]+)\]"', text) + re.findall(r"\.whl\)\[([a-z,]+)\]", text)
    assert ours, "installs none of our extras"
    for extra in ours:
        for name in extra.split(","):
            assert name in EXTRAS, f"{dockerfile.name} installs unknown extra [{name}]"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.relative_to(REPO_ROOT).name)
def test_entry_point_runs(dockerfile):
    entrypoint = json.loads(_instruction(dockerfile.read_text(), "ENTRYPOINT") or "[]")
    assert entrypoint, "no ENTRYPOINT"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in SOURCE_DIRS)}
    if entrypoint[0] == "tardigrade":
        argv = [sys.executable, "-m", "tardigrade_operator.cli", "operator", "run", "--help"]
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "--all-namespaces" in result.stdout
    else:
        assert entrypoint[:2] == ["python", "-m"]
        # With no operator environment the trainer must say what is missing, not crash.
        argv = [sys.executable, "-m", entrypoint[2]]
        clean = {k: v for k, v in env.items() if not k.startswith("TARDIGRADE_")}
        result = subprocess.run(argv, env=clean, capture_output=True, text=True, timeout=120)
        assert result.returncode != 0
        assert "TARDIGRADE_" in result.stdout + result.stderr
