"""Accelerator snapshots: the state's copy off the devices before the next step reuses them,
to host memory now, or to spare device memory first, read to the host afterwards.

A training step donates its state: the next step reuses the state's device buffers, so
every byte of the saved step must be off them before that step starts. Off the CPU that
leaves two places for it:

* host memory: the device->host copy runs at the link's speed (about 3.2 GB/s on the TPU
  v5e host we measured; 2 GiB in 0.67 s) and the next step waits for it;
* device memory: a copy on the device runs at memory speed (2 GiB in 8 ms on a v5e), and is
  read to host memory from the save thread while the loop trains on.

Device memory is the scarce resource: a second copy of the whole state halves the model a
user can train. So a staged copy takes only device memory the training does not need (the
device's capacity less the compiled step's needs and what the runtime saw it use, less a
margin: stagingbudget.py), and at most what the user allows. The shards that fit are staged
on the device, the rest are copied to host memory before `save` returns. A staged copy the
device cannot allocate after all is copied to host memory instead, for that save: a save
never stops the training for want of device memory.

Where there is room it pays: the 184M reference trainer on a TPU v5e (batch 32, 2.1 GiB
staged) lost 3-6% of each save's duration, against about 30% waiting for a host copy. The
device overlaps a device->host read with the steps only while one read is in flight: a loop
of 0.13 s steps lost 11-48 ms while 2 GiB of staged copies were read from one thread, against
0.54-0.62 s waiting for a host copy, and 0.44-0.49 s when 16 threads read at once. So the
staged copies are taken by one program (compiled ahead by `prepare`) and read by one thread,
in order, from the moment they are staged (docs/benchmarks/tpu-chip.md).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from tardigrade_checkpoint.background import SaveThread
from tardigrade_checkpoint.stagingbudget import (  # noqa: F401  (re-exported)
    MARGIN_FRACTION,
    MIN_MARGIN_BYTES,
    DeviceBudget,
    device_memory,
)

log = logging.getLogger(__name__)

def _copy_all(xs: list[jax.Array]) -> list[jax.Array]:
    # `copy_p` (jnp.array(copy=True)), which jit does not forward to its input: the copies
    # are new buffers, safe from the next step's donation.
    return [jnp.array(x, copy=True) for x in xs]


class CopyPrograms:
    """One compiled program per layout copying a device's staged shards in one go.

    A program copies 2 GiB in 8 ms on a v5e, `jax.device_put(..., may_alias=False)` in
    213 ms, but compiling the program took 0.7-2.5 s: the first save of a layout copies with
    `device_put` (no compile, the next step waits for the slower copy) and compiles the
    program on a thread of its own for the saves after it."""

    def __init__(self) -> None:
        self._ready: dict[Any, Any] = {}
        self._compiling: dict[Any, threading.Thread] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(xs: Sequence[jax.Array]) -> Any:
        return tuple((x.shape, x.dtype, x.sharding) for x in xs)

    def copy(self, xs: list[jax.Array]) -> list[jax.Array]:
        program = self.compile_ahead(xs)
        if program is not None:
            return list(program(xs))
        return list(jax.device_put(xs, [x.sharding for x in xs], may_alias=False))

    def compile_ahead(self, xs: Sequence[jax.Array]) -> Any:
        """The program for `xs`'s layout if it is ready, else None, after starting its
        compile on a thread of its own if none is under way."""
        key = self.key(xs)
        with self._lock:
            program = self._ready.get(key)
            if program is None and key not in self._compiling:
                specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                         for x in xs]
                thread = threading.Thread(target=self._compile, args=(key, specs),
                                          name="checkpoint-copy-compile", daemon=True)
                self._compiling[key] = thread
                thread.start()
        return program

    def _compile(self, key: Any, specs: list[jax.ShapeDtypeStruct]) -> None:
        try:
            program = jax.jit(_copy_all).lower(specs).compile()
        except Exception as err:  # the device_put copy stays: slower, never wrong
            log.warning("compiling the snapshot's copy program failed: %s", err)
            return
        with self._lock:
            self._ready[key] = program

    def wait_compiled(self, xs: Sequence[jax.Array]) -> bool:
        """Wait for the program of `xs`'s layout, if one is compiling; whether it is ready."""
        key = self.key(xs)
        with self._lock:
            thread = self._compiling.get(key)
        if thread is not None:
            thread.join()
        with self._lock:
            return key in self._ready


_programs = CopyPrograms()


_reader: SaveThread | None = None
_reader_lock = threading.Lock()
_read_orders = itertools.count()  # the device reader's queue order, across every reader
_order_lock = threading.Lock()


def _device_reader() -> SaveThread:
    """The one thread that reads staged copies to the host, in the order they were staged.
    One, because the device overlaps a read with the steps only while it is the only one in
    flight: on a TPU v5e a loop of 0.13 s steps lost 11-48 ms per 2 GiB read from one
    thread, 0.22-0.35 s from 4 and 0.44-0.49 s from 16 (as much as a copy waited for), and
    the save's writers run 16 threads."""
    global _reader
    with _reader_lock:
        if _reader is None:
            _reader = SaveThread("checkpoint-device-read")
        return _reader


class StagedShard:
    """A shard's copy in device memory, read to the host by the device reader as soon as it
    is staged (its device memory freed then); `np.asarray` waits for that read.

    Takes what the writers take of a shard's host data (`np.asarray`, `.nbytes`, `.shape`,
    `.dtype`)."""

    def __init__(self, copy: jax.Array, reader: SaveThread | None = None,
                 on_free: Callable[[], None] | None = None) -> None:
        self.shape = tuple(copy.shape)
        self.dtype = np.dtype(copy.dtype)
        self.nbytes = int(copy.nbytes)
        # Only the read changes it, or `release` once the read was cancelled or has ended.
        self._copy: jax.Array | None = copy
        self._on_free = on_free  # told once, when the device memory is given back
        # Where its read stands in the reader's queue (reads run in submission order): a
        # commit takes its pieces in that order (memory_tier.commit).
        reader = reader or _device_reader()
        with _order_lock:
            self.read_order = next(_read_orders)
            self._read = reader.submit(self._to_host)

    def _to_host(self) -> np.ndarray:
        assert self._copy is not None, "a released staged shard is never read"
        try:
            return np.asarray(self._copy)
        finally:  # read or not (a failed read is the save's error), it leaves the device
            self._free()

    def _free(self) -> None:
        copy, self._copy = self._copy, None
        if copy is None:
            return
        copy.delete()
        if self._on_free is not None:
            self._on_free()

    @property
    def device_bytes(self) -> int:
        """Device memory this shard still holds."""
        return 0 if self._copy is None else self.nbytes

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        host = self._read.result()
        return host if dtype is None else host.astype(dtype, copy=False)

    def release(self) -> None:
        """Free the device memory, read or not (a save that failed before its write)."""
        if not self._read.cancel():
            self._read.exception()  # a read under way ends first (and frees it)
        self._free()


class Budget(Protocol):
    """What `stage` spends (stagingbudget.DeviceBudget), and the account of what its staged
    copies hold until they are read (shared by every snapshot that stages)."""

    def for_device(self, device: Any) -> int: ...

    def staging_failed(self, device: Any, nbytes: int) -> None: ...

    def staged(self, device: Any, nbytes: int) -> None: ...

    def freed(self, device: Any, nbytes: int) -> None: ...


@dataclasses.dataclass
class StagingReport:
    """What one `stage` did on this host: its devices' budgets (summed), the bytes staged,
    and the bytes whose staged copy the device could not allocate (copied to the host)."""

    budget_bytes: int = 0
    staged_bytes: int = 0
    failed_bytes: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


def is_allocation_failure(err: BaseException) -> bool:
    """The runtime's error for a device allocation it could not make (XLA's
    RESOURCE_EXHAUSTED; a TPU's program allocation failure)."""
    if not isinstance(err, jax.errors.JaxRuntimeError):
        return False
    text = str(err).lower()
    return any(sign in text for sign in ("resource_exhausted", "out of memory",
                                         "allocationfailure", "failed to allocate"))


def stage(shards: Sequence[tuple[Any, jax.Array]], budget: Budget,
          report: StagingReport | None = None) -> dict[int, StagedShard | np.ndarray]:
    """Host data for each (device, single-device array), by position: staged on the device
    (a StagedShard) while the device's budget lasts, largest shards first (they hold the loop
    longest), else copied to host memory here (the caller waits for those).

    A device's staged shards are copied at once (`CopyPrograms`), dispatched before this
    returns to a loop that donates them (the device orders the copy before the next step's
    writes): one program rather than one per shard, since every program launched between
    two steps delays the next step (while hundreds of 8 MiB slices were staged one program
    each, the reference trainer's steps took 0.5-0.65 s instead of 0.1 s on a v5e).

    A device that cannot allocate its staged copies (the budget misjudged it) has those
    shards copied to host memory instead, the failure told to the budget (it stages less
    next time) and to `report`, or logged as a warning without one."""
    told = report is not None  # the caller logs the failures it is told of
    report = report if report is not None else StagingReport()
    to_stage, direct, budgets = _choose(shards, budget)
    report.budget_bytes += sum(budgets.values())
    staged: dict[int, StagedShard | np.ndarray] = {}
    for device, positions in to_stage.items():
        xs = [shards[i][1] for i in positions]
        try:
            copies = _programs.copy(xs)
        except Exception as err:
            if not is_allocation_failure(err):
                raise
            nbytes = sum(int(x.nbytes) for x in xs)
            budget.staging_failed(device, nbytes)
            report.failed_bytes += nbytes
            report.errors.append(f"{device}: {(str(err) or type(err).__name__).splitlines()[0]}")
            if not told:
                log.warning("staging %d bytes of a snapshot on %s failed, copied to host memory "
                            "instead: %s", nbytes, device, report.errors[-1])
            direct.extend(positions)
            continue
        for i, copy in zip(positions, copies, strict=True):
            nbytes = int(copy.nbytes)
            budget.staged(device, nbytes)  # until its read gives the device memory back
            staged[i] = StagedShard(copy, on_free=functools.partial(budget.freed, device,
                                                                     nbytes))
            report.staged_bytes += nbytes
    # Every direct copy in flight before the first wait: the device's DMA engines overlap.
    for i in direct:
        shards[i][1].copy_to_host_async()
    for i in direct:
        staged[i] = np.asarray(shards[i][1])
    return staged


def prepare(shards: Sequence[tuple[Any, jax.Array]], budget: Budget) -> None:
    """Start compiling the copy programs a `stage` of `shards` (of the same layout) would
    run, so that the first save need not copy by `device_put`: on a v5e the reference
    trainer's first staged save lost 0.6 s of steps (16% of the save) that way, the saves
    after it 0.06-0.2 s. The budget's headroom is measured here (call it after a step)."""
    to_stage, _, _ = _choose(shards, budget)
    for positions in to_stage.values():
        _programs.compile_ahead([shards[i][1] for i in positions])


def _choose(shards: Sequence[tuple[Any, jax.Array]], budget: Budget
            ) -> tuple[dict[Any, list[int]], list[int], dict[Any, int]]:
    """(positions to stage, by device; positions to copy to the host now; each device's
    budget)."""
    budgets: dict[Any, int] = {}
    remaining: dict[Any, int] = {}
    to_stage: dict[Any, list[int]] = {}
    direct: list[int] = []
    order = sorted(range(len(shards)), key=lambda i: -int(shards[i][1].nbytes))
    for i in order:
        device, data = shards[i]
        if device not in remaining:
            budgets[device] = remaining[device] = budget.for_device(device)
        size = int(data.nbytes)
        if 0 < size <= remaining[device]:
            to_stage.setdefault(device, []).append(i)
            remaining[device] -= size
        else:
            direct.append(i)
    return to_stage, direct, budgets


def staged_bytes(values: Sequence[Any]) -> int:
    return sum(v.nbytes for v in values if isinstance(v, StagedShard))
