"""Where things are under a checkpoint root, and what a step's arrays look like in zarr3.

    step_00000100/arrays/<leaf name>/   one zarr3 array per state leaf, chunk = one shard
                                        (or one piece of a replicated one: writers.py)
    step_00000100/metadata.json         the commit marker (marker.py), written last
    tardigrade-root.json                owner, fence and lines of the root (rootrecord.py)

Pure naming: nothing here touches storage.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import jax

from tardigrade_checkpoint import chunkfiles
from tardigrade_checkpoint.errors import CheckpointError, CheckpointIOError

COMMIT_FILE = "metadata.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def step_of(directory: str) -> int | None:
    """The step a top-level directory name holds, or None for anything else."""
    match = _STEP_DIR.match(directory)
    return int(match.group(1)) if match else None


def array_dir(directory: str, name: str) -> str:
    """A leaf's array, relative to the root."""
    return f"{directory}/arrays/{name}"


def kvstore_spec(path: str) -> dict[str, Any]:
    """TensorStore kvstore spec for a local path or a gs://bucket/prefix URL."""
    if path.startswith("gs://"):
        bucket, _, prefix = path[len("gs://") :].partition("/")
        if not bucket:
            raise CheckpointIOError(f"checkpoint path {path!r} names no bucket")
        prefix = prefix.strip("/")
        return {"driver": "gcs", "bucket": bucket, "path": f"{prefix}/" if prefix else ""}
    if "://" in path:
        raise CheckpointIOError(f"unsupported checkpoint path {path!r} (use gs:// or a path)")
    return {"driver": "file", "path": os.path.abspath(path).rstrip("/") + "/"}


def array_spec(kv_spec: dict[str, Any], directory: str, name: str, *, write: bool = False,
               strict: bool = False) -> dict[str, Any]:
    """`write`: store chunks equal to the fill value too (TensorStore leaves them out by
    default), so that `strict` reads can treat a missing chunk as an error, not zeros."""
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": {**kv_spec, "path": f"{kv_spec['path']}{array_dir(directory, name)}/"},
    }
    if write:
        spec["store_data_equal_to_fill_value"] = True
    if strict:
        spec["fill_missing_data_reads"] = False
    return spec


def array_metadata(shape: Sequence[int], dtype: str, chunk: Sequence[int],
                   checksum: bool) -> dict[str, Any]:
    """The zarr3 metadata of a saved leaf: one chunk per written piece, raw little-endian
    bytes (plus a crc32c with `checksum`), at the keys the chunk-file backend writes."""
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if checksum:
        codecs.append({"name": "crc32c"})
    return {
        "shape": list(shape),
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
        "chunk_key_encoding": chunkfiles.CHUNK_KEY_ENCODING,
        "codecs": codecs,
    }


def leaf_names(tree: Any) -> list[str]:
    """Stable, path-derived names of a pytree's leaves (the manifest keys)."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = []
    for path, _ in paths:
        name = jax.tree_util.keystr(path, simple=True, separator="/") or "root"
        names.append(re.sub(r"[^A-Za-z0-9_.\-/]", "_", name))
    if len(set(names)) != len(names):
        raise CheckpointError("state leaves do not have unique names")
    return names
