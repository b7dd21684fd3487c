"""The training step compiled ahead of time, called like the `hax.named_jit` function it was
lowered from.

What `named_jit(...).lower(...).compile()` gives takes the arguments named_jit hands its inner
`jax.jit`, not the step's own: the arrays of the function and of its arguments, split into
donated and kept (everything else is static, part of the program), and it returns the
outputs' arrays with a `Static` holding the rest (haliax/partitioning.py,
`_NamedJitWrapper._call` and `_named_pjit_cache`). `CompiledStep` does that split and join, so
that the loop runs the executable it compiled or loaded (step_cache.py) instead of asking jit
for it, which would compile the step again wherever JAX's own cache misses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from haliax.tree_util import hashable_combine, hashable_partition


class CompiledStep:
    """`compiled` (lowered from `named_jit(fn, donate_args=donate_args)` with `example_args`),
    called with the step's own positional arguments."""

    def __init__(self, fn: Callable[..., Any], compiled: Any, donate_args: tuple[bool, ...],
                 example_args: tuple[Any, ...]) -> None:
        self._dynamic_fun = hashable_partition(fn, eqx.is_array)[0]
        self._compiled = compiled
        self._donate = donate_args
        # The example may hold abstract arrays (`lower_abstract`): they are inputs too.
        self._static = hashable_partition((example_args, {}), _array_or_abstract)[1]

    def __call__(self, *args: Any) -> Any:
        dynamic, static = hashable_partition((args, {}), eqx.is_array)
        if static != self._static:
            # The program holds the static parts it was lowered with: these would be ignored.
            raise ValueError("the step was compiled for arguments of another structure "
                             "(their non-array parts differ): lower and compile it again")
        donated, kept = eqx.partition((self._dynamic_fun, dynamic),
                                      (False, (self._donate, {})))
        out, out_static = self._compiled(donated, kept)
        return hashable_combine(out, out_static.value)


def _array_or_abstract(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def lower_abstract(fn: Callable[..., Any], donate_args: tuple[bool, ...],
                   axis_mapping: Any, *args: Any) -> Any:
    """`named_jit(fn, axis_resources=axis_mapping, donate_args=donate_args).lower(*args)`
    where `args` may hold `jax.ShapeDtypeStruct`s (with their shardings) in place of arrays.

    So the step can be lowered, and compiled or loaded from a cache, before the state it
    runs on exists: while the state is being restored. haliax's own `lower` takes only
    arrays as the program's inputs (anything else is a static part of the program); this is
    its lowering (haliax/partitioning.py, `_NamedJitWrapper._call`) with abstract arrays
    taken as inputs too, so the program, and JAX's cache key for it, are those of the
    `named_jit` call on the real arrays."""
    import haliax as hax
    from haliax.partitioning import _named_pjit_cache, infer_resource_partitions

    dynamic_fun, static_fun = hashable_partition(fn, eqx.is_array)
    dynamic_args, static_args = hashable_partition((args, {}), _array_or_abstract)
    donated, kept = eqx.partition((dynamic_fun, dynamic_args), (False, (donate_args, {})))
    with hax.axis_mapping(axis_mapping):
        output_shape = eqx.filter_eval_shape(fn, *args)
        out_shardings = infer_resource_partitions(output_shape, axis_mapping)
        jitted = _named_pjit_cache(fn, out_shardings=out_shardings)
        return jitted.lower(donated, kept, (static_fun, static_args))


def predicted_trees(fn: Callable[..., Any], donate_args: tuple[bool, ...], args: tuple[Any, ...],
                    out_example: Any) -> tuple[Any, Any]:
    """The argument and output trees of `lower_abstract(fn, donate_args, _, *args)`, worked out
    without tracing `fn`: the arguments' from their own partition (as the lowering splits
    them), the outputs' from `out_example`, what the caller knows `fn` returns (for a step that
    returns its state's structure, the state and its other outputs as abstract arrays). What
    is known this way is a claim: step_cache.py keeps it only where the lowering agreed."""
    from haliax.partitioning import Static

    dynamic_fun, _ = hashable_partition(fn, eqx.is_array)
    dynamic_args, _ = hashable_partition((args, {}), _array_or_abstract)
    donated, kept = eqx.partition((dynamic_fun, dynamic_args), (False, (donate_args, {})))
    out_dynamic, out_static = hashable_partition(out_example, _array_or_abstract)
    return (jax.tree_util.tree_structure(((donated, kept), {})),
            jax.tree_util.tree_structure((out_dynamic, Static(out_static))))


def memory_analysis(compiled: Any) -> Any:
    """XLA's memory analysis of a compiled program (per device: temp, argument, output,
    alias and generated code sizes), or None where the backend does not say."""
    try:
        return compiled.memory_analysis()
    except Exception:  # backends and deserialized executables without the analysis
        return None


def working_memory_bytes(analysis: Any) -> int | None:
    """From `memory_analysis`: the device memory the program needs beyond its inputs and
    outputs (XLA's buffer assignment: activations kept for the backward pass, scratch), or
    None where the backend does not say. What is left of a device after it and the state is
    what a save may stage its snapshot in (checkpoint/stagingbudget.py)."""
    temp = getattr(analysis, "temp_size_in_bytes", None)
    return int(temp) if temp is not None else None
