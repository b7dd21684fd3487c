"""Product code carries no test hooks: faults are injected through constructor arguments
(checkpoint/faults.py, default no-op) by code under tests/, never read from the environment."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The local cluster is the test bed: its own fault model (disruptions) is its job.
PRODUCT = [REPO / "operator", REPO / "trainer_image"]
HOOK_MODULES = ("testhooks", "test_hooks", "injected_faults", "faulty_trainer")


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "tests" or any(p in HOOK_MODULES for p in parts):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and node.value.startswith("TARDIGRADE_TEST")):
            found.append(f"{path.relative_to(REPO)}:{node.lineno} names the test-only "
                         f"variable {node.value}")
    return found


def test_no_product_module_imports_a_test_hook() -> None:
    files = [p for root in PRODUCT for p in root.rglob("*.py") if ".venv" not in p.parts]
    assert len(files) > 50  # the walk found the packages
    problems = [problem for path in files for problem in _problems(path)]
    assert not problems, "test hooks in product modules:\n" + "\n".join(problems)
    assert not list((REPO / "trainer_image").glob("*/testhooks.py"))
