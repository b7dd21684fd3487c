"""The trainer package's old module names still import, for one more release: the very module
under its new name (so isinstance checks and monkeypatching act on one module), with a
DeprecationWarning that names the new import and points at the importing line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, SOURCE_DIRS

TRAINER_IMAGE = REPO_ROOT / "trainer_image"


def _modules(package: str) -> list[str]:
    folder = TRAINER_IMAGE / package
    return sorted(p.relative_to(folder).with_suffix("").as_posix().replace("/", ".")
                  for p in folder.rglob("*.py") if p.name != "__init__.py")


# SDK modules written after the move: they never had an old name.
SDK_SINCE_THE_MOVE = {"memory_session", "notice", "phase_clock", "replica_server"}
# Old name -> new name, from the files that moved (every SDK module used to be a module of
# tardigrade_trainer; the checkpoint library was its `checkpoint` package, but coordination).
MOVED = {
    "tardigrade_trainer.contract": "tardigrade_contract.contract",
    "tardigrade_trainer.boundedjson": "tardigrade_contract.boundedjson",
    "tardigrade_trainer.coordination": "tardigrade_checkpoint.coordination",
    "tardigrade_trainer.checkpoint": "tardigrade_checkpoint",
    **{f"tardigrade_trainer.checkpoint.{m}": f"tardigrade_checkpoint.{m}"
       for m in _modules("tardigrade_checkpoint") if m != "coordination"},
    **{f"tardigrade_trainer.{m}": f"tardigrade_sdk.{m}" for m in _modules("tardigrade_sdk")
       if m not in SDK_SINCE_THE_MOVE},
}

PROBE = """
import importlib, json, sys, warnings
moved = json.loads(sys.argv[1])
found = {}
import tardigrade_trainer
found["jax after the package"] = "jax" in sys.modules
for old, new in moved.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(f"import {old}")
    module = sys.modules[old]
    found[old] = {
        "same": module is importlib.import_module(new),
        "spec": module.__spec__.name,
        "warnings": [(w.category.__name__, str(w.message), w.filename) for w in caught
                     if "tardigrade_trainer" in str(w.message)],
        "attribute": getattr(sys.modules[old.rpartition(".")[0]],
                             old.rpartition(".")[2]) is module,
    }
    if old == "tardigrade_trainer.contract":
        found["jax after the contract"] = "jax" in sys.modules
# Patching through the old name patches the one module every user of the new name sees.
import tardigrade_trainer.session as old_session
import tardigrade_sdk.session
old_session.write_termination = "patched"
found["patched"] = tardigrade_sdk.session.write_termination == "patched"
from tardigrade_trainer.checkpoint import CheckpointManager
from tardigrade_checkpoint import CheckpointManager as NewManager
found["class"] = CheckpointManager is NewManager
for missing in ("tardigrade_trainer.nonexistent", "tardigrade_trainer.checkpoint.nonexistent"):
    try:
        importlib.import_module(missing)
    except ModuleNotFoundError as err:
        found[missing] = err.name
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def found() -> dict:
    """One fresh interpreter imports every old name (the contract's first, before any jax)."""
    env = {"PYTHONPATH": ":".join(str(d) for d in SOURCE_DIRS), "JAX_PLATFORMS": "cpu",
           "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps(MOVED)], env=env,
                            capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_old_names_are_the_new_modules_with_a_warning_naming_the_new_import(found):
    assert len(MOVED) > 40  # the walk found the moved modules
    for old, new in MOVED.items():
        got = found[old]
        assert got["same"] and got["attribute"], old
        assert got["spec"] == new, f"{old}: the module's own spec was replaced"
        # One warning, for the old name itself, attributed to the importing line.
        assert got["warnings"] == [["DeprecationWarning",
                                    f"{old} moved: import {new} instead (the old name goes in "
                                    "tardigrade 0.3.0)", "<string>"]], got["warnings"]
    assert found["patched"] and found["class"]
    # Names that never existed stay missing, under their own name.
    assert found["tardigrade_trainer.nonexistent"] == "tardigrade_trainer.nonexistent"
    assert found["tardigrade_trainer.checkpoint.nonexistent"] == (
        "tardigrade_checkpoint.nonexistent")


def test_the_package_and_the_old_contract_name_import_no_jax(found):
    assert next(iter(MOVED)) == "tardigrade_trainer.contract"
    assert found["jax after the package"] is False
    assert found["jax after the contract"] is False
