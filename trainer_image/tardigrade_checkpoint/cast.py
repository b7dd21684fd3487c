"""Dtype casts on restore (float32 -> bfloat16 and back), as Orbax's `RestoreArgs(dtype=...)`.

The dtype a leaf is restored as is, in order: the explicit `dtype` argument of `restore`
(one dtype for every floating-point leaf, or a mapping from leaf name to dtype), else the
target leaf's dtype, else (no target) the stored dtype. Shapes must still match exactly.

TensorStore converts, as Orbax has it do (`get_cast_tspec_deserialize` wraps the array in
TensorStore's `cast` driver, orbax/checkpoint/_src/serialization/tensorstore_utils.py). When
restore checks digests, the stored bytes are read and checked first and the checked buffer is
then converted (`to_dtype`): the digests are of the bytes as stored, and a cast buffer would
never match them. Without a check, the store itself is opened through the cast driver
(`on_read`) and one read both reads and converts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from tardigrade_checkpoint.errors import CheckpointUsageError
from tardigrade_checkpoint.leaves import ReadTarget

DTypes = Any  # a dtype, a mapping leaf name -> dtype, or None


def _numeric(dtype: np.dtype) -> bool:
    return dtype == np.bool_ or bool(jax.dtypes.issubdtype(dtype, np.number))


def with_dtypes(names: Sequence[str], targets: Sequence[ReadTarget], dtype: DTypes
                ) -> list[ReadTarget]:
    """`targets` with the explicit `dtype` argument applied."""
    if dtype is None:
        return list(targets)
    if isinstance(dtype, Mapping):
        unknown = sorted(set(dtype) - set(names))
        if unknown:
            raise CheckpointUsageError(
                f"restore dtype names leaves the state does not have: {unknown}; its leaves "
                f"are {list(names)[:10]}{' ...' if len(names) > 10 else ''}")
        wanted = {name: np.dtype(value) for name, value in dtype.items()}
    else:
        # One dtype: for every floating-point leaf (step counters and PRNG keys stay as
        # they are), the usual wish when restoring float32 weights as bfloat16.
        one = np.dtype(dtype)
        wanted = {name: one for name, target in zip(names, targets, strict=True)
                  if target.impl is None and jax.dtypes.issubdtype(target.dtype, np.floating)}
    result = []
    for name, target in zip(names, targets, strict=True):
        if name in wanted and target.impl is not None:
            raise CheckpointUsageError(f"restore dtype for {name!r}: a PRNG key cannot be cast")
        result.append(dataclasses.replace(target, dtype=wanted[name]) if name in wanted
                      else target)
    return result


def mismatch(name: str, saved: Mapping[str, Any] | None, want: ReadTarget) -> str | None:
    """Why checkpoint leaf `saved` cannot be restored as `want`, or None if it can."""
    recorded = want.recorded()
    if saved is None or {**saved, "dtype": None} != {**recorded, "dtype": None}:
        return f"{name}: checkpoint has {saved}, model needs {recorded}"
    if saved["dtype"] == recorded["dtype"]:
        return None
    stored = np.dtype(saved["dtype"])
    if want.impl is not None or not (_numeric(stored) and _numeric(want.dtype)):
        return (f"{name}: checkpoint has {saved}, model needs {recorded}, and "
                f"{stored.name} cannot be cast to {want.dtype.name}")
    return None


def needed(store: ts.TensorStore, dtype: np.dtype) -> bool:
    return bool(store.dtype.numpy_dtype != dtype)


def on_read(store: ts.TensorStore, dtype: np.dtype) -> ts.TensorStore:
    """`store` read as `dtype`: TensorStore converts as it reads."""
    return ts.cast(store, dtype) if needed(store, dtype) else store


def to_dtype(buffer: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A checked buffer converted to `dtype` by TensorStore (the buffer itself if it is)."""
    if buffer.dtype == dtype:
        return buffer
    return np.asarray(ts.cast(ts.array(buffer, copy=False), dtype).read().result())
