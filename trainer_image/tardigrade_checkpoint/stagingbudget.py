"""How much device memory an accelerator snapshot may stage: the budget staging.py spends.

By default the budget is automatic: what the device has left once the training has what it
needs, that is the device's capacity (`bytes_limit`) less the training's footprint less a
margin. The footprint is the larger of two views of the step's needs:

* what the runtime saw: the peak in use plus the peak the runtime reserved for its programs
  (a TPU reserves a program's working memory at load and reports it as `bytes_reserved`,
  not in use: the 184M reference step reserved 13.3 of a v5e's 15.7 GiB, and a staged copy
  taken from it made the next step's load fail, "RuntimeProgramAllocationFailure");
* what the compiled step says it needs (`compiled.memory_analysis()`, per device): the bytes
  in use now (the state it reads, whatever else the loop keeps on the device) plus its working
  memory, its code and its outputs that do not reuse a donated input. This one is known before
  the step has run, and where the runtime allocates a program's working memory per run (a
  GPU) it is the only one that sees it between two steps.

The two are not summed: on a TPU the working memory is in both (reserved, and planned).

The margin (`margin_bytes`): a tenth of the device, at least 512 MiB. The figures above are
what the runtime and XLA plan; the margin covers what they leave out: fragmentation (a
staged copy needs contiguous buffers), the runtime's own allocations (collectives' scratch,
the copy program's code, the next batch placed while a step runs) and small programs the loop
runs beside its step. A save that would go past it is not worth its risk: an out-of-memory
stops the training, a host copy only slows one save.

`checkpoint_snapshot_device_mib` (the trainer's setting; `snapshot_device_bytes` of the
manager) caps the automatic budget, or turns staging off with 0. A platform that reports no
memory figures (the CPU) stages nothing.

One budget serves every snapshot of a process: the bucket save's and the memory tier's
(docs/memory-tier.md). The headroom and the cap are for all staged copies at once, so the
budget keeps account of the copies still on the devices (`staged`, `freed`) and gives a
snapshot only what the others' outstanding copies leave of it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

MARGIN_FRACTION = 0.1
MIN_MARGIN_BYTES = 512 << 20

# Where a save's budget came from, as the logs say it.
AUTO = "auto"  # no setting: what the training leaves free
SETTING = "setting"  # a cap in MiB, within what the training leaves free
OFF = "off"  # 0: never stage

MemoryStats = Callable[[Any], Mapping[str, Any] | None]


def device_memory(device: Any) -> dict[str, int] | None:
    """JAX's memory statistics of `device` (bytes_limit, bytes_in_use, peak_bytes_in_use,
    bytes_reserved...), or None where the platform keeps none."""
    try:
        stats = device.memory_stats()
    except Exception:  # platforms without the call (the CPU) raise or return None
        return None
    if not stats or "bytes_limit" not in stats or "bytes_in_use" not in stats:
        return None
    return dict(stats)


@dataclasses.dataclass(frozen=True)
class DeviceFigures:
    """One device's memory as its runtime reports it, in bytes."""

    limit: int
    in_use: int
    peak_in_use: int = 0
    reserved: int = 0
    peak_reserved: int = 0

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any] | None) -> DeviceFigures | None:
        """None where the statistics lack the device's capacity or what is in use."""
        if not stats or "bytes_limit" not in stats or "bytes_in_use" not in stats:
            return None
        in_use, reserved = int(stats["bytes_in_use"]), int(stats.get("bytes_reserved", 0))
        return cls(limit=int(stats["bytes_limit"]), in_use=in_use,
                   peak_in_use=max(in_use, int(stats.get("peak_bytes_in_use", in_use))),
                   reserved=reserved,
                   peak_reserved=max(reserved, int(stats.get("peak_bytes_reserved", reserved))))


_ANALYSIS_FIELDS = ("temp_size_in_bytes", "generated_code_size_in_bytes",
                    "output_size_in_bytes", "alias_size_in_bytes")


def program_extra_bytes(program: Any) -> int | None:
    """Device memory a compiled program needs beyond its inputs, per device: its working
    memory, its code and its outputs that do not reuse a donated input. `program`: a compiled
    executable (`jax.jit(f).lower(...).compile()`) or its `memory_analysis()`; None where
    the backend does not say (a deserialized executable may not)."""
    analysis = program
    if hasattr(program, "memory_analysis"):
        try:
            analysis = program.memory_analysis()
        except Exception:  # backends and deserialized executables without the analysis
            return None
    if analysis is None:
        return None
    try:
        temp, code, output, alias = (int(getattr(analysis, name)) for name in _ANALYSIS_FIELDS)
    except (AttributeError, TypeError, ValueError):
        return None
    return max(0, temp) + max(0, code) + max(0, output - alias)


def margin_bytes(limit: int) -> int:
    return max(MIN_MARGIN_BYTES, int(limit * MARGIN_FRACTION))


def footprint_bytes(figures: DeviceFigures, program_extra: int | None) -> int:
    """The training's device memory at its peak: the larger of the runtime's peaks and the
    compiled step's plan (the module's docstring says why the larger, not the sum)."""
    seen = figures.peak_in_use + figures.peak_reserved
    planned = figures.in_use + max(figures.reserved, program_extra or 0)
    return max(seen, planned)


def headroom_bytes(figures: DeviceFigures, program_extra: int | None) -> int:
    """The automatic budget: capacity less the training's footprint less the margin."""
    return max(0, figures.limit - footprint_bytes(figures, program_extra)
               - margin_bytes(figures.limit))


def free_now_bytes(figures: DeviceFigures) -> int:
    """What a save may take at this moment: capacity less what is in use and reserved now,
    less the margin. Not less the step's planned needs: where the runtime allocates them per
    run (a GPU), a step still running when the save starts has them in use already, and they
    would count twice; the headroom, measured once, leaves them to the step."""
    return max(0, figures.limit - figures.in_use - figures.reserved
               - margin_bytes(figures.limit))


class DeviceBudget:
    """Bytes of device memory a snapshot may stage, per device.

    `limit_bytes`: None (automatic, the default): the headroom (`headroom_bytes`) measured at
    the first save (or when the compiled step is noted), and at each save no more than is
    free at that moment (`free_now_bytes`).
    The first save's headroom holds for later ones: their own staging raises the device's
    peak, which must not shrink the budget save after save. 0: never stage. A number: at most
    that many bytes, within the automatic budget.

    `memory_stats(device)`: the device's statistics (JAX's `memory_stats`, by default).

    A staging copy the device could not allocate (`staging_failed`) halves what later saves
    may stage on that device, below the size that failed: the loop's memory use is steady, so
    the same size would fail at every save, each paying for a failed allocation and a host
    copy; halving finds a size that fits within a few saves and still stages what it can.

    Copies staged and not yet read to the host (`outstanding`, kept by `staged` and `freed`)
    count against the headroom, the cap and the size after a failure: a bucket save and a
    memory snapshot staging one after the other never hold more than the budget together.
    (What is free now needs no such account: the runtime counts those copies in use.)
    """

    def __init__(self, limit_bytes: int | None = None,
                 memory_stats: MemoryStats | None = None) -> None:
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"a staging budget must be >= 0 bytes, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._memory_stats = memory_stats
        self.program_extra: int | None = None
        self._headroom: dict[Any, int] = {}
        self._after_failure: dict[Any, int] = {}
        self._outstanding: dict[Any, int] = {}
        self._lock = threading.Lock()  # the device reader frees what save threads staged

    @property
    def source(self) -> str:
        """Where the budget comes from: "auto", "setting" (a cap) or "off"."""
        if self.limit_bytes is None:
            return AUTO
        return OFF if self.limit_bytes == 0 else SETTING

    def note_program(self, program: Any) -> None:
        """The compiled step (or its memory analysis): its needs count as the training's."""
        extra = program_extra_bytes(program)
        if extra != self.program_extra:
            self.program_extra = extra
            self._headroom.clear()  # measured without it

    def figures(self, device: Any) -> DeviceFigures | None:
        stats = (self._memory_stats or device_memory)(device)
        return DeviceFigures.from_stats(stats)

    def for_device(self, device: Any) -> int:
        if self.limit_bytes == 0:
            return 0
        figures = self.figures(device)
        if figures is None:
            return 0
        if device not in self._headroom:
            self._headroom[device] = headroom_bytes(figures, self.program_extra)
        held = self.outstanding(device)
        budget = min(self._headroom[device] - held, free_now_bytes(figures))
        if device in self._after_failure:
            budget = min(budget, self._after_failure[device] - held)
        if self.limit_bytes is not None:
            budget = min(budget, self.limit_bytes - held)
        return max(0, budget)

    def staged(self, device: Any, nbytes: int) -> None:
        """`nbytes` were staged on `device`: they hold the budget until `freed`."""
        with self._lock:
            self._outstanding[device] = self._outstanding.get(device, 0) + nbytes

    def freed(self, device: Any, nbytes: int) -> None:
        """A staged copy of `nbytes` on `device` was read to the host (or released)."""
        with self._lock:
            left = self._outstanding.get(device, 0) - nbytes
            if left > 0:
                self._outstanding[device] = left
            else:
                self._outstanding.pop(device, None)

    def outstanding(self, device: Any) -> int:
        """Bytes staged on `device` and not yet freed, by every snapshot of this budget."""
        with self._lock:
            return self._outstanding.get(device, 0)

    def staging_failed(self, device: Any, nbytes: int) -> None:
        """The device could not allocate a staged copy of `nbytes`: stage less from now on."""
        self._after_failure[device] = min(self._after_failure.get(device, nbytes), nbytes) // 2
