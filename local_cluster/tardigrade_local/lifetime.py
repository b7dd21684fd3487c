"""Child processes that die with the process that started them, however it dies."""

from __future__ import annotations

import contextlib
import ctypes
import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

_PR_SET_PDEATHSIG = 1
# Loaded in the parent: between fork and exec a multi-threaded parent's child should do as
# little as it can (no dlopen, whose lock another thread may have held at the fork).
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent() -> None:
    """In the child, between fork and exec (`preexec_fn`): SIGKILL when the parent dies
    (prctl(2) PR_SET_PDEATHSIG; Linux)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def stop(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """Ask a child server to stop (SIGTERM), kill it if it has not within `timeout`, and reap
    it."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def orphan_records(directory: Path) -> Iterator[tuple[Path, dict]]:
    """The JSON records in `directory` whose owner process (`owner`, `owner_started`) is gone:
    what a killed run left for a later one to tear down."""
    for record in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            data = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        with contextlib.suppress(psutil.Error):
            if psutil.Process(data["owner"]).create_time() == data["owner_started"]:
                continue  # its owner still runs and will tear it down itself
        yield record, data
