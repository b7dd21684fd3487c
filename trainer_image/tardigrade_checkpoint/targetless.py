"""Restore without a target: shapes, dtypes and the tree come from the commit marker.

Orbax does the same when `restore` gets no item: the tree it returns is the one recorded in
the checkpoint's metadata (`if item is None: item = value_metadata_tree` in
`BasePyTreeCheckpointHandler.restore`, orbax/checkpoint/_src/handlers/
base_pytree_checkpoint_handler.py). Two differences, both deliberate:

* The tree is nested dicts, one level per `/`-separated segment of the leaf names
  (`{"params": {"w": ...}}` for leaf `params/w`). Leaf names do not record whether a level was
  a dict, a list or a dataclass; a loop that wants its own types back passes a target.
* Without a sharding, leaves come back as numpy arrays read whole on every process (typed
  PRNG keys as JAX key arrays on this process's first device). Orbax instead falls back to
  the sharding recorded at save time, "unsafe when restoring on a different topology"
  (`_deserialize_shardings`, orbax/checkpoint/_src/serialization/jax_array_handlers.py).
  With `sharding` (one `jax.sharding.Sharding` for every leaf, e.g. a fully replicated
  `NamedSharding(mesh, PartitionSpec())`, or a function of (leaf name, shape)), leaves are
  `jax.Array`s laid out as requested, on any mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from tardigrade_checkpoint import leaves as leafkinds
from tardigrade_checkpoint.errors import CheckpointUsageError

ShardingChoice = jax.sharding.Sharding | Callable[[str, tuple[int, ...]], jax.sharding.Sharding]


def _key_leaf(entry: Mapping[str, Any]) -> tuple[tuple[int, ...], Any]:
    """(logical shape, key dtype) of a typed PRNG key stored as its key data."""
    impl = entry["prng_impl"]
    key = jax.eval_shape(lambda: jax.random.key(0, impl=impl))
    trailing = len(jax.eval_shape(jax.random.key_data, key).shape)
    physical = tuple(entry["shape"])
    return physical[:len(physical) - trailing], key.dtype


def _leaf(name: str, entry: Mapping[str, Any], sharding: ShardingChoice | None) -> Any:
    dtype = np.dtype(entry["dtype"])  # stored as recorded: int64 stays int64 on the host
    shape = tuple(entry["shape"])
    if entry.get("prng_impl"):
        shape, dtype = _key_leaf(entry)
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    elif sharding is None:
        return leafkinds.ReadTarget(shape, dtype, None)
    chosen = sharding(name, shape) if callable(sharding) else sharding
    return jax.ShapeDtypeStruct(shape, dtype, sharding=chosen)


def target(arrays: Mapping[str, Mapping[str, Any]], sharding: ShardingChoice | None = None
           ) -> dict[str, Any]:
    """A restore target for every leaf in a commit marker's `arrays`, as nested dicts."""
    tree: dict[str, Any] = {}
    for name in sorted(arrays):
        *parents, last = name.split("/")
        level = tree
        for depth, part in enumerate(parents):
            level = level.setdefault(part, {})
            if not isinstance(level, dict):
                raise CheckpointUsageError(_clash(name, "/".join(parents[:depth + 1])))
        if last in level:
            raise CheckpointUsageError(_clash(name, name))
        level[last] = _leaf(name, arrays[name], sharding)
    return tree


def _clash(name: str, other: str) -> str:
    return (f"leaf {name!r} cannot be placed in a tree of nested dicts next to leaf {other!r}: "
            "restore this checkpoint with a target (the state's own structure)")
