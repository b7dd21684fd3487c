"""Imports between our packages go one way (docs/trainer.md, "Four packages"):

    tardigrade_trainer (reference trainer) -> tardigrade_sdk -> tardigrade_checkpoint
                                                             -> tardigrade_contract

and the operator imports only the contract of the trainer's packages, so its image can hold
the contract alone. The walk reads every import statement, those inside functions included
(the lazy imports that keep jax out of a start-up)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

OURS = ("tardigrade_contract", "tardigrade_checkpoint", "tardigrade_sdk", "tardigrade_trainer",
        "tardigrade_operator", "tardigrade_local")
# Package -> the packages of ours it may import besides itself.
ALLOWED = {
    "tardigrade_contract": set(),
    "tardigrade_checkpoint": {"tardigrade_contract"},
    "tardigrade_sdk": {"tardigrade_contract", "tardigrade_checkpoint"},
    "tardigrade_trainer": {"tardigrade_contract", "tardigrade_checkpoint", "tardigrade_sdk"},
    # Of the trainer's packages, the contract only. `tardigrade local` and `demo` import the
    # local cluster lazily, and without the [local] extra name it (tests/test_images.py).
    "tardigrade_operator": {"tardigrade_contract", "tardigrade_local"},
}
FOLDERS = {"tardigrade_operator": REPO_ROOT / "operator" / "tardigrade_operator",
           **{p: REPO_ROOT / "trainer_image" / p for p in ALLOWED if p != "tardigrade_operator"}}


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; relative imports resolved
    against `package` (the file's top-level package)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, package if node.level else node.module or ""))
    return found


def violations(folder: Path, package: str, allowed: set[str],
               stdlib_only: bool = False) -> list[str]:
    problems = []
    for path in sorted(folder.rglob("*.py")):
        for line, module in imported_modules(path, package):
            top = module.split(".")[0]
            where = f"{path.relative_to(folder.parent)}:{line} imports {module}"
            if top in OURS and top != package and top not in allowed:
                problems.append(where)
            elif stdlib_only and top not in OURS and top not in sys.stdlib_module_names:
                problems.append(f"{where} (not the standard library)")
    return problems


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_the_packages_below_it(package):
    folder = FOLDERS[package]
    assert len(list(folder.rglob("*.py"))) >= 2, f"no modules found under {folder}"
    assert violations(folder, package, ALLOWED[package],
                      stdlib_only=package == "tardigrade_contract") == []


def test_the_operator_and_the_trainer_packages_do_import_the_contract():
    # The rule above would pass vacuously if the walk saw no imports of ours at all.
    for package in ("tardigrade_operator", "tardigrade_checkpoint", "tardigrade_sdk",
                    "tardigrade_trainer"):
        tops = {module.split(".")[0] for path in FOLDERS[package].rglob("*.py")
                for _, module in imported_modules(path, package)}
        assert "tardigrade_contract" in tops, package


def test_an_upward_import_is_found_wherever_it_is(tmp_path):
    package = tmp_path / "tardigrade_checkpoint"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("from tardigrade_contract import contract\n")
    (package / "inner" / "lazy.py").write_text(
        "def f():\n    from tardigrade_sdk import session\n    import tardigrade_trainer.train\n")
    found = violations(package, "tardigrade_checkpoint", ALLOWED["tardigrade_checkpoint"])
    assert found == ["tardigrade_checkpoint/inner/lazy.py:2 imports tardigrade_sdk",
                     "tardigrade_checkpoint/inner/lazy.py:3 imports tardigrade_trainer.train"]


def test_a_third_party_import_in_the_contract_is_found(tmp_path):
    package = tmp_path / "tardigrade_contract"
    package.mkdir()
    (package / "contract.py").write_text("import json\nfrom pydantic import BaseModel\n")
    assert violations(package, "tardigrade_contract", set(), stdlib_only=True) == [
        "tardigrade_contract/contract.py:2 imports pydantic (not the standard library)"]
