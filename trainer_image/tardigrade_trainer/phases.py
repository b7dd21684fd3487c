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
# Set by a trainer that restarts in process (inplace.replace_process): exec keeps the process's
# start time in /proc, so the new image's start is passed on.
ENV_REPLACED_AT = "TARDIGRADE_PROCESS_REPLACED_AT"


def process_started() -> float | None:
    """When this process was started (Linux: /proc), before the interpreter's own start-up,
    or when its image was last replaced; None where that is not known."""
    replaced = os.environ.get(ENV_REPLACED_AT)
    if replaced:
        try:
            return float(replaced)
        except ValueError:
            pass
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
