"""One hash of a whole state, equal across meshes iff the values are: for tests and debugging
(it gathers every leaf onto every host)."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

from tardigrade_checkpoint.layout import leaf_names


def gathered_state_hash(tree: Any) -> str:
    """SHA-256 over every leaf's full (gathered) value: equal across meshes iff values are."""
    from jax.experimental import multihost_utils

    digest = hashlib.sha256()
    for name, leaf in zip(leaf_names(tree), jax.tree_util.tree_leaves(tree), strict=True):
        value = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        digest.update(name.encode())
        digest.update(str(value.dtype).encode() + str(value.shape).encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()
