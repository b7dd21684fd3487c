"""Zarr v3 group metadata for a step, so that plain zarr and TensorStore users can browse it.

Every state leaf is already a zarr v3 array (TensorStore's `zarr3` driver writes its
`zarr.json`). Zarr v3 wants a group at every ancestor of a node: "To create a group at
hierarchy path P, perform set(meta_key(P), value) ... and ensure the existence of groups at
all ancestor paths of P" (zarr-specs docs/v3/core/index.rst, "Storage", "Operations"), and
zarr-python 3 lists only explicit groups. So process 0 writes a group `zarr.json` at the step
directory, at `arrays/` and at every intermediate directory of a leaf name, before any shard
is written; the commit marker stays the last write of a step.

The step group's attributes describe the save (format, step, every leaf with its shape and
dtype) under the key `tardigrade`; they do not make a step committed: the commit marker
(`metadata.json`) does, as before. docs/checkpoint-format.md is the specification.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

GROUP_FILE = "zarr.json"
ARRAYS_DIR = "arrays"
ATTRIBUTES_KEY = "tardigrade"


class Leaf(Protocol):
    """What a save knows of a leaf before writing it (the manager's host copy)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    prng_impl: str | None


def array_entry(leaf: Leaf) -> dict[str, Any]:
    """The description of a leaf in the step's attributes (and in the commit marker)."""
    entry: dict[str, Any] = {"shape": list(leaf.shape), "dtype": leaf.dtype}
    if leaf.prng_impl:
        entry["prng_impl"] = leaf.prng_impl
    return entry


def group_paths(names: Iterable[str]) -> list[str]:
    """Directories under a step that must hold a group: "" (the step), "arrays", and every
    proper prefix of a leaf name, under "arrays".

    A prefix that is itself a leaf (leaves named "a" and "a/b") would put an array inside an
    array, which zarr does not allow: it gets no group, so its `zarr.json` stays the array's.
    Names with empty, "." or ".." segments get no groups either: no zarr path has them.
    """
    names = list(names)
    leaves = set(names)
    paths = {"", ARRAYS_DIR}
    for name in names:
        parts = name.split("/")
        if any(part in ("", ".", "..") for part in parts):
            continue
        for end in range(1, len(parts)):
            prefix = "/".join(parts[:end])
            if prefix not in leaves:
                paths.add(f"{ARRAYS_DIR}/{prefix}")
    return sorted(paths)


def attributes(step: int, format_version: str, leaves: Iterable[Leaf]) -> dict[str, Any]:
    return {ATTRIBUTES_KEY: {
        "format": format_version,
        "step": step,
        "commit_marker": "metadata.json",
        "arrays": {leaf.name: array_entry(leaf) for leaf in leaves},
    }}


def documents(step: int, format_version: str, leaves: Iterable[Leaf]) -> dict[str, bytes]:
    """Key (relative to the step directory) -> group metadata document to write there."""
    leaves = list(leaves)
    result = {}
    for path in group_paths(leaf.name for leaf in leaves):
        document: dict[str, Any] = {"zarr_format": 3, "node_type": "group", "attributes": {}}
        if not path:
            document["attributes"] = attributes(step, format_version, leaves)
        key = f"{path}/{GROUP_FILE}" if path else GROUP_FILE
        result[key] = json.dumps(document, sort_keys=True, indent=1).encode()
    return result


def write(kv: Any, directory: str, docs: Mapping[str, bytes]) -> list[Any]:
    """Start writing `docs` under `directory` of the TensorStore KvStore `kv`: its futures."""
    return [kv.write(f"{directory}/{key}", value) for key, value in docs.items()]
