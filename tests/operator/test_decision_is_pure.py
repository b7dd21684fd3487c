"""The decision does no I/O: no module it imports, however indirectly, reaches the API server,
the network, a subprocess or kopf. Its tests then need no server, and a pass decides the same
from the same observation."""

from __future__ import annotations

import ast
from pathlib import Path

import tardigrade_operator

PACKAGE = Path(tardigrade_operator.__file__).parent
DECISION = PACKAGE / "decision"
FORBIDDEN_LIBRARIES = {"kubernetes", "kopf", "aiohttp", "asyncio", "requests", "socket",
                       "subprocess"}
# The kubernetes client's model classes are data shapes (api/corev1.py builds the CRD's volume
# types from them); they make no request.
ALLOWED = {"kubernetes.client.models"}
# The operator's own modules that talk to the cluster or wire kopf.
FORBIDDEN_MODULES = {"tardigrade_operator.apply.kube", "tardigrade_operator.handlers",
                     "tardigrade_operator.apply", "tardigrade_operator.observation.observe",
                     "tardigrade_operator.observation.reader"}


def _source(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != "tardigrade_operator":
        return None
    if len(parts) == 1:
        return PACKAGE / "__init__.py"
    relative = Path(*parts[1:])
    for candidate in (PACKAGE / relative.with_suffix(".py"), PACKAGE / relative / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(module: str) -> set[str]:
    path = _source(module)
    assert path is not None, module
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "kubernetes.client" and all(
                alias.name == "models" for alias in node.names):
            found.add("kubernetes.client.models")
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            # `from tardigrade_operator import x`: x is a module of the operator.
            found |= {f"{node.module}.{alias.name}" for alias in node.names
                      if _source(f"{node.module}.{alias.name}") is not None
                      and node.module.startswith("tardigrade_operator")}
    return found


def _closure(root: str) -> dict[str, set[str]]:
    """Each operator module the root reaches -> what it imports."""
    seen: dict[str, set[str]] = {}
    todo = [root]
    while todo:
        module = todo.pop()
        if module in seen or _source(module) is None:
            continue
        seen[module] = _imports(module)
        todo += [m for m in seen[module] if m.startswith("tardigrade_operator")]
    return seen


def _decision_modules() -> list[str]:
    names = (".".join(path.relative_to(PACKAGE).with_suffix("").parts)
             for path in DECISION.rglob("*.py"))
    return sorted(f"tardigrade_operator.{name}".removesuffix(".__init__") for name in names)


def test_the_decision_imports_nothing_that_does_io():
    graph: dict[str, set[str]] = {}
    for module in _decision_modules():
        graph |= _closure(module)
    assert "tardigrade_operator.decision.decide" in graph
    assert "tardigrade_operator.decision.recovery.in_place" in graph
    offences = sorted(
        f"{module} imports {name}" for module, names in graph.items() for name in names
        if (name not in ALLOWED and name.split(".")[0] in FORBIDDEN_LIBRARIES)
        or any(name == f or name.startswith(f + ".") for f in FORBIDDEN_MODULES))
    assert offences == []


def test_the_walk_notices_an_io_import():
    # The handlers wire kopf: the same walk from them must flag it, or the test above proves
    # nothing.
    graph = _closure("tardigrade_operator.handlers")
    assert any(name == "kopf" for names in graph.values() for name in names)


def test_every_import_of_an_operator_module_names_one_in_this_tree():
    """A module moved without its importers updated could still be found in another copy of
    the package on the path (an editable install): every `from tardigrade_operator... import
    name` must name a module here, or a name its module's own file defines."""
    unresolved = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.startswith("tardigrade_operator")):
                continue
            source = _source(node.module)
            if source is None:
                unresolved.append(f"{path.name}: {node.module}")
                continue
            defined = source.read_text()
            unresolved += [f"{path.name}: {node.module}.{alias.name}" for alias in node.names
                           if _source(f"{node.module}.{alias.name}") is None
                           and alias.name not in defined]
    assert unresolved == []
