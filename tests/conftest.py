"""Shared fixtures: paths into the repository and the bad-input corpus."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "examples"
CRD_FILE = REPO_ROOT / "crds" / "trainingjob.yaml"
SOURCE_DIRS = [REPO_ROOT / "operator", REPO_ROOT / "trainer_image", REPO_ROOT / "local_cluster"]


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def bad_trainingjob_cases() -> list[dict[str, Any]]:
    cases = load_yaml(REPO_ROOT / "tests" / "data" / "bad_trainingjobs.yaml")
    base = load_yaml(EXAMPLES / "trainingjob.yaml")
    for case in cases:
        case["document"] = jsonpatch.apply_patch(copy.deepcopy(base), case["ops"])
    return cases


@pytest.fixture
def example_job() -> dict[str, Any]:
    return load_yaml(EXAMPLES / "trainingjob.yaml")
