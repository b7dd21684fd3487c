"""Shared fixtures: paths into the repository and the bad-input corpus."""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonpatch
import pytest
import yaml

# In-process checkpoint tests need several CPU devices. XLA reads this once, when jax first
# initialises, and any test module collected earlier may import jax: so here, before them all
# (this module imports none of it).
if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

if TYPE_CHECKING:
    from tests.apiserver import SharedApi

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "examples"
CRD_FILE = REPO_ROOT / "crds" / "trainingjob.yaml"
SOURCE_DIRS = [REPO_ROOT / "operator", REPO_ROOT / "trainer_image", REPO_ROOT / "local_cluster"]


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def expand(value: Any) -> Any:
    """Huge values are written as generators in the corpus files, e.g. "!repeat x 40000"."""
    if isinstance(value, dict):
        return {k: expand(v) for k, v in value.items()}
    if isinstance(value, list):
        return [expand(v) for v in value]
    if not (isinstance(value, str) and value.startswith(("!repeat", "!nest"))):
        return value
    kind, *rest = value.split()
    if kind == "!repeat":
        return rest[0] * int(rest[1])
    count = int(rest[0])
    if kind == "!nest":
        nested: Any = 1
        for _ in range(count):
            nested = {"n": nested}
        return nested
    if kind == "!repeat-env":
        return [{"name": f"VAR_{i}", "value": "x"} for i in range(count)]
    if kind == "!repeat-toleration":
        return [{"key": f"example.com/taint-{i}", "operator": "Exists"} for i in range(count)]
    raise ValueError(f"unknown corpus generator {value!r}")


# Corpus documents nest far deeper than Python's default recursion limit lets copy.deepcopy
# and jsonpatch walk (3 frames a level); the API server stores up to 10,000 levels.
_CORPUS_RECURSION_LIMIT = 40_000


def corpus_cases(file_name: str) -> list[dict[str, Any]]:
    """A corpus of JSON Patches against examples/trainingjob.yaml, applied."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), _CORPUS_RECURSION_LIMIT))
    cases = load_yaml(REPO_ROOT / "tests" / "data" / file_name)
    base = load_yaml(EXAMPLES / "trainingjob.yaml")
    for case in cases:
        case["document"] = jsonpatch.apply_patch(copy.deepcopy(base), expand(case["ops"]))
    return cases


def bad_trainingjob_cases() -> list[dict[str, Any]]:
    return corpus_cases("bad_trainingjobs.yaml")


@pytest.fixture
def example_job() -> dict[str, Any]:
    return load_yaml(EXAMPLES / "trainingjob.yaml")


@pytest.fixture(scope="session")
def shared_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedApi]:
    """A real control plane without nodes, shared by this worker's tests that need
    kube-apiserver's own checks but no cluster of their own (tests/apiserver.py)."""
    from tests.apiserver import SharedApi, start_shared

    cluster = start_shared(tmp_path_factory.mktemp("shared-api") / "cluster")
    try:
        yield SharedApi(cluster)
    finally:
        cluster.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with slow tests first, each module's tests kept together in their order.

    `scripts/test` runs two modules at a time; started last, a long end-to-end module would
    run on alone while the other worker sits idle."""
    slow_modules = {item.module.__name__ for item in items
                    if item.module is not None and item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.module is None
                                 or item.module.__name__ not in slow_modules))

