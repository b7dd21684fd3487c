"""Where a trainer's start-up goes: wall-clock marks of its phases, logged as one line.

A recovery's time to the first step is mostly the new trainer's own start-up (the process,
Python and JAX imports, the gang's rendezvous, `jax.distributed`, the restore, compiling or
loading the step). The marks are taken on the way, by whoever reaches each phase (the image's
entry point, the session, the reference loop), and the session logs them as a `startup` event
once its log exists, so that a bench can split a recovery without any test hook. Marks are
seconds since the epoch, the clock of every other log line. Dependency-free: the entry point
marks before it imports jax.
"""

from __future__ import annotations

import os
import time

_marks: dict[str, float] = {}
# When the trainer this process runs started, where that is not this process's own start: a
# child of a keeper (attempts.py) runs the container's first attempt from the keeper's start,
# and every later one from its fork.
_started_at: float | None = None


def forked(started_at: float | None, keep_marks: bool) -> None:
    """This process is a keeper's child whose trainer counts from `started_at`; a child that
    runs a later attempt has its imports done at its start, and none of the earlier marks."""
    global _started_at
    _started_at = started_at
    if not keep_marks:
        _marks.clear()
        if started_at is not None:
            _marks["imports_done"] = started_at


def process_started() -> float | None:
    """When this process's trainer was started (Linux: /proc), before the interpreter's own
    start-up; None where that is not known."""
    if _started_at is not None:
        return _started_at
    try:
        with open("/proc/self/stat") as f:
            # The command name (field 2) may hold spaces: count fields after its ")".
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/uptime") as f:
            # Uptime has centiseconds where /proc/stat's boot time has whole seconds.
            uptime = float(f.read().split()[0])
        return time.time() - uptime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def mark(name: str) -> None:
    """Record that this process reached phase `name` now (the first time counts)."""
    _marks.setdefault(name, time.time())


def marks() -> dict[str, float]:
    """The phases reached so far, with the process's start when known."""
    started = process_started()
    found = {"process_started": started} if started is not None else {}
    return {**found, **{name: round(when, 3) for name, when in _marks.items()}}
