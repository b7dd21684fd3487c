"""Server-side apply for whole objects: each field manager owns the fields it last applied.

Applying again without a field the same manager applied before removes that field, which is
what users expect from `kubectl apply --server-side`. Ownership is kept by the server (not
exposed as managedFields); lists count as single fields; conflicts between managers are not
detected.
"""

from __future__ import annotations

from typing import Any

from . import patch
from .errors import bad_request

Path = tuple[str, ...]
_IDENTITY = {("apiVersion",), ("kind",), ("metadata", "name"), ("metadata", "namespace")}


def owned_paths(applied: dict[str, Any]) -> set[Path]:
    """The fields an applied configuration sets (identity fields belong to no one)."""
    return leaf_paths(applied) - _IDENTITY


def leaf_paths(value: Any, prefix: Path = ()) -> set[Path]:
    if isinstance(value, dict) and value:
        out: set[Path] = set()
        for key, item in value.items():
            out |= leaf_paths(item, (*prefix, key))
        return out
    return {prefix} if prefix else set()


def _remove(obj: dict[str, Any], path: Path) -> None:
    parents = [obj]
    cur: Any = obj
    for key in path[:-1]:
        if not isinstance(cur, dict) or key not in cur:
            return
        cur = cur[key]
        parents.append(cur)
    if isinstance(cur, dict):
        cur.pop(path[-1], None)
    # Drop maps the removal left empty, as if they had never been applied.
    for depth in range(len(path) - 1, 0, -1):
        parent, child = parents[depth - 1], parents[depth]
        if isinstance(child, dict) and not child:
            parent.pop(path[depth - 1], None)
        else:
            break


def apply(current: dict[str, Any], applied: Any, builtin: bool,
          previous: set[Path]) -> tuple[dict[str, Any], set[Path]]:
    """The object after applying `applied`, and the paths its manager now owns."""
    if not isinstance(applied, dict):
        raise bad_request("error decoding YAML: the applied configuration is not an object")
    owned = owned_paths(applied)
    merged = patch.apply_patch(current, applied, patch.APPLY, builtin)
    for path in previous - owned - _IDENTITY:
        if not any(path[:len(p)] == p or p[:len(path)] == path for p in owned):
            _remove(merged, path)
    return merged, owned


def require_manager(field_manager: str | None) -> str:
    if not field_manager:
        raise bad_request("PATCH, field manager is required for apply requests")
    return field_manager
