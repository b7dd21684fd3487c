"""The kinds of state leaf a checkpoint holds, and the leaves it refuses, with the reason.

* A global `jax.Array` (sharded or replicated over the gang's mesh): each distinct shard is
  written once, by one of the hosts holding it.
* A typed PRNG key (`jax.random.key`): its dtype has no numpy equivalent, so its key data
  (`jax.random.key_data`, uint32 with trailing dimensions) is what is stored, with the name
  of its implementation; restore wraps the data again (`jax.random.wrap_key_data`). Orbax
  does the same (orbax/checkpoint/_src/serialization/cloud_pathways_array_handler.py).
* A host value (numpy array or scalar, Python int/float/bool): the same on every host by
  the program's construction; process 0 writes it, every host reads it whole.

Refused, with the leaf's name:
* A host-local `jax.Array` in a gang of several processes: one that lives on this host's
  devices only (`is_fully_addressable`, e.g. made by `jax.device_put` onto a local device or
  a mesh of local devices, or by pmap). Every host holds a different array under the same
  name and would write it to the same chunks; one host's values would silently win. Orbax
  refuses these too (ArrayHandler.serialize in
  orbax/checkpoint/_src/serialization/jax_array_handlers.py).
* A sharding that cuts a dimension into parts that do not divide it (a dimension of 6 over
  a mesh axis of 4): JAX cannot build such an array (`IndivisibleError`), so the message
  names the leaf, the dimension and the mesh axes, not the checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

HOST_SCALARS = (bool, int, float)


class LeafError(ValueError):
    """A leaf that a checkpoint cannot hold as given; the message says which and why."""


def is_prng_key(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def is_host_value(leaf: Any) -> bool:
    """A numpy array/scalar or a Python number: saved by process 0, read whole by everyone."""
    return isinstance(leaf, (np.ndarray, np.generic, *HOST_SCALARS))


def key_impl(leaf: Any) -> str:
    return str(jax.random.key_impl(leaf))


def check_global(name: str, leaf: jax.Array, process_count: int) -> None:
    if process_count > 1 and leaf.is_fully_addressable:
        raise LeafError(
            f"state leaf {name!r} is a host-local jax.Array (all of it lives on process "
            f"{jax.process_index()}'s devices: {leaf.sharding}) in a gang of {process_count} "
            "processes: every host would write its own copy to the same chunks and one would "
            "silently win. Make it a global array (a NamedSharding over the gang's mesh, or "
            "jax.make_array_from_process_local_data), or pass it as a numpy value if it is "
            "the same on every host")


def check_divisible(name: str, shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> None:
    """Raise LeafError naming the dimension and mesh axes if `sharding` cannot split `shape`."""
    try:
        sharding.shard_shape(shape)
        return
    except ValueError:
        pass
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    problems = []
    for dim, size in enumerate(shape):
        axes: tuple[str, ...] = ()
        if spec is not None and dim < len(spec) and spec[dim] is not None:
            entry = spec[dim]
            axes = tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
        parts = math.prod(mesh.shape[a] for a in axes) if mesh is not None and axes else None
        if parts and size % parts:
            named = " x ".join(f"{a!r} ({mesh.shape[a]})" for a in axes)
            problems.append(f"dimension {dim} (size {size}) is split over mesh axis {named}, "
                            f"{parts} parts that do not divide it")
    detail = "; ".join(problems) or f"{sharding} does not divide shape {shape} evenly"
    raise LeafError(f"state leaf {name!r} of shape {shape}: {detail}. Choose a mesh whose "
                    "axes divide the dimension, or a partition spec that leaves it unsplit")


@dataclasses.dataclass(frozen=True)
class ReadTarget:
    """What restore reads for one target leaf: its stored (physical) form and how to finish.

    `sharding` is None for a host value; `impl` is set for a typed PRNG key.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: jax.sharding.Sharding | None
    impl: str | None = None
    python_type: type | None = None  # a Python scalar target gets its own type back

    def recorded(self) -> dict[str, Any]:
        """The commit marker's `arrays` entry this target must match."""
        entry: dict[str, Any] = {"shape": list(self.shape), "dtype": self.dtype.name}
        if self.impl is not None:
            entry["prng_impl"] = self.impl
        return entry

    def finish(self, stored: Any) -> Any:
        if self.impl is not None:
            return jax.random.wrap_key_data(stored, impl=self.impl)
        if self.python_type is not None:
            return self.python_type(np.asarray(stored).item())
        if self.sharding is None and not self.shape and isinstance(stored, np.ndarray):
            return stored[()]  # a numpy scalar target
        return stored


def read_target(name: str, leaf: Any) -> ReadTarget:
    """How to read target leaf `leaf` (a ShapeDtypeStruct, an array or a host value)."""
    if isinstance(leaf, ReadTarget):  # already one (a restore without target: targetless.py)
        return leaf
    if isinstance(leaf, HOST_SCALARS):
        value = np.asarray(leaf)
        return ReadTarget(value.shape, value.dtype, None, python_type=type(leaf))
    if isinstance(leaf, (np.ndarray, np.generic)):
        return ReadTarget(tuple(leaf.shape), np.dtype(leaf.dtype), None)
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        raise LeafError(f"restore target {name!r} ({type(leaf).__name__}) carries no sharding: "
                        "give a jax.ShapeDtypeStruct(shape, dtype, sharding=...) or an array")
    shape = tuple(leaf.shape)
    check_divisible(name, shape, sharding)
    if not is_prng_key(leaf):
        return ReadTarget(shape, np.dtype(leaf.dtype), sharding)
    physical = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, leaf.dtype))
    trailing = len(physical.shape) - len(shape)
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec, *([None] * trailing)))
    elif not sharding.is_fully_replicated:
        raise LeafError(f"restore target {name!r} is a PRNG key array with a "
                        f"{type(sharding).__name__}: use a NamedSharding")
    return ReadTarget(tuple(physical.shape), np.dtype(physical.dtype), sharding,
                      impl=_impl_of(shape, leaf.dtype))


def _impl_of(shape: tuple[int, ...], dtype: Any) -> str:
    """The PRNG implementation's name of a key dtype (abstractly: no array is made)."""
    names: list[str] = []
    jax.eval_shape(lambda key: names.append(key_impl(key)), jax.ShapeDtypeStruct(shape, dtype))
    return names[0]
