"""Child processes that die with the process that started them, however it dies."""

from __future__ import annotations

import ctypes
import signal
import subprocess

_PR_SET_PDEATHSIG = 1
# Loaded in the parent: between fork and exec a multi-threaded parent's child should do as
# little as it can (no dlopen, whose lock another thread may have held at the fork).
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent() -> None:
    """In the child, between fork and exec (`preexec_fn`): SIGKILL when the parent dies
    (prctl(2) PR_SET_PDEATHSIG; Linux)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Ask a child server to stop (SIGTERM), kill it if it has not within 10 s, and reap it."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
