"""Host snapshots: what `save` copies off the devices before it returns to the training loop.

Each host copies only the shards the write plan (writers.py) gives it; the background save
writes from these copies while the loop goes on and may donate the device buffers. On the CPU
a copy is a private device buffer (device memory is host memory); on an accelerator it is a
copy in spare device memory read to the host later, or a host copy made now (staging.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from tardigrade_checkpoint import layout, staging, writers
from tardigrade_checkpoint import leaves as leafkinds


@dataclasses.dataclass(frozen=True)
class HostLeaf:
    """One state leaf after its device->host copy: only the shards this host must write."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunk: tuple[int, ...]
    # numpy data, (CPU backend) a private on-device copy that is already host memory, or
    # (accelerators) a copy staged in device memory (staging.StagedShard).
    shards: list[tuple[tuple[slice, ...], Any]]
    prng_impl: str | None = None  # a typed PRNG key leaf, stored as its key data

    def recorded(self) -> dict[str, Any]:
        """The commit marker's `arrays` entry of this leaf."""
        return {"shape": list(self.shape), "dtype": self.dtype,
                **({"prng_impl": self.prng_impl} if self.prng_impl else {})}


class Snapshotter:
    """Copies a state's shards to host memory; one per manager (it caches the write plan).

    `budget`: the device memory an accelerator snapshot may stage (staging.DeviceBudget)."""

    def __init__(self, process_id: int, process_count: int,
                 budget: staging.DeviceBudget | None = None) -> None:
        self.process_id = process_id
        self.process_count = process_count
        self.budget = budget or staging.DeviceBudget()
        self._write_plan: tuple[Any, dict[str, writers.LeafPlan]] | None = None
        # What the last snapshot staged (nothing on the CPU).
        self.last_staging = staging.StagingReport()

    @property
    def last_staged_bytes(self) -> int:
        """Device memory the last snapshot staged (0 on the CPU, or with nothing staged)."""
        return self.last_staging.staged_bytes

    def copy_to_host(self, state: Any) -> list[HostLeaf]:
        """This host's part of `state`; LeafError for a leaf a checkpoint cannot hold."""
        names, leaves, impls = self._leaves(state)
        plans, mine = self._plans(names, leaves)
        on_cpu = _on_cpu(mine)
        if on_cpu:
            # CPU "device" memory is host memory: a private copy made by the runtime
            # (dispatched asynchronously, ordered before any later donation of the original
            # buffer) is the snapshot, and the background thread views it as numpy without
            # copying. One batched device_put dispatches all copies several times faster
            # than a copy per leaf, and dispatch is all the loop waits for.
            arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
            copies = jax.device_put([leaves[i] for i in arrays],
                                    [leaves[i].sharding for i in arrays], may_alias=False)
            for i, copy in zip(arrays, copies, strict=True):
                leaves[i] = copy
        self.last_staging = staging.StagingReport()
        copies_of = _my_shards(names, leaves, mine)
        if not on_cpu:
            # Off the CPU the next step, which may donate these buffers, must not start before
            # they are copied: to spare device memory (read later) or to the host (now).
            flat = [(name, device, data) for name, by_device in copies_of.items()
                    for device, data in by_device.items()]
            got = staging.stage([(device, data) for _, device, data in flat], self.budget,
                                self.last_staging)
            for i, (name, device, _) in enumerate(flat):
                copies_of[name][device] = got[i]
        host = []
        for name, leaf in zip(names, leaves, strict=True):
            if isinstance(leaf, jax.Array):
                shape = tuple(leaf.shape)
                chunk = plans[name].chunk
                copies = copies_of[name]
                shards = [
                    (w.region, copies[w.device] if w.region == w.shard
                     else writers.ShardPiece(copies[w.device], w.local()))
                    for w in mine[name]
                ]
                dtype = np.dtype(leaf.dtype).name
            else:
                value = np.asarray(leaf)
                shape, chunk = value.shape, tuple(max(1, c) for c in value.shape)
                full = tuple(slice(None) for _ in shape)
                shards = [(full, value.copy())] if self.process_id == 0 else []
                dtype = value.dtype.name
            host.append(HostLeaf(name, shape, dtype, chunk, shards, impls.get(name)))
        return host

    def prepare(self, state: Any, step_program: Any = None) -> None:
        """Get ready to snapshot states of `state`'s layout: the write plan, and (on an
        accelerator that stages) the staged copy's program, compiled in the background.
        `step_program`: the compiled training step (or its memory analysis), whose needs the
        staging budget leaves to it (stagingbudget.py)."""
        if step_program is not None:
            self.budget.note_program(step_program)
        names, leaves, _ = self._leaves(state)
        _, mine = self._plans(names, leaves)
        if _on_cpu(mine) or self.budget.limit_bytes == 0:
            return
        # The budget's headroom is measured once, from the device's peaks: wait for the step
        # that computes `state` to have run (once per process), or they may not show it yet.
        jax.block_until_ready([leaf for leaf in leaves if isinstance(leaf, jax.Array)])
        copies_of = _my_shards(names, leaves, mine)
        staging.prepare([(device, data) for by_device in copies_of.values()
                         for device, data in by_device.items()], self.budget)

    def _leaves(self, state: Any) -> tuple[list[str], list[Any], dict[str, str]]:
        """(leaf names, leaves with typed PRNG keys as their key data, the keys' impls)."""
        leaves = list(jax.tree_util.tree_leaves(state))
        names = layout.leaf_names(state)
        impls: dict[str, str] = {}
        for i, (name, leaf) in enumerate(zip(names, leaves, strict=True)):
            if isinstance(leaf, jax.Array):
                leafkinds.check_global(name, leaf, self.process_count)
                if leafkinds.is_prng_key(leaf):
                    impls[name] = leafkinds.key_impl(leaf)
                    leaves[i] = jax.random.key_data(leaf)
            elif not leafkinds.is_host_value(leaf):
                raise leafkinds.LeafError(
                    f"state leaf {name!r} is a {type(leaf).__name__}: a checkpoint holds "
                    "jax.Arrays, numpy arrays and Python numbers")
        return names, leaves, impls

    def _plans(self, names: list[str], leaves: list[Any]
               ) -> tuple[dict[str, writers.LeafPlan], dict[str, list[writers.Write]]]:
        """(the write plan of every array leaf, the writes of this host's devices)."""
        named = [(name, leaf) for name, leaf in zip(names, leaves, strict=True)
                 if isinstance(leaf, jax.Array)]
        # The plan depends only on the layout, which a training loop keeps: computing it
        # (seconds for thousands of devices) once keeps it out of every later save's stall.
        layout_key = tuple((name, leaf.shape, leaf.dtype, leaf.sharding) for name, leaf in named)
        if self._write_plan is None or self._write_plan[0] != layout_key:
            self._write_plan = (layout_key, writers.plan([writers.layout(name, leaf)
                                                          for name, leaf in named]))
        plans = self._write_plan[1]
        mine = {name: [w for w in p.writes if w.device.process_index == self.process_id]
                for name, p in plans.items()}
        return plans, mine


def _on_cpu(mine: dict[str, list[writers.Write]]) -> bool:
    return all(w.device.platform == "cpu" for ws in mine.values() for w in ws)


def _my_shards(names: list[str], leaves: list[Any],
               mine: dict[str, list[writers.Write]]) -> dict[str, dict[Any, Any]]:
    """Per array leaf, the single-device arrays of the shards this host writes."""
    copies_of: dict[str, dict[Any, Any]] = {}
    for name, leaf in zip(names, leaves, strict=True):
        if not isinstance(leaf, jax.Array):
            continue
        wanted = {w.device for w in mine[name]}
        # One `addressable_shards` per leaf: each call makes new single-device arrays, and a
        # host copy started on one is not the host copy of the next.
        copies_of[name] = {shard.device: shard.data for shard in leaf.addressable_shards
                           if shard.device in wanted}
    return copies_of
