"""Rank 0's side of the rendezvous, run in a thread, for tests that play the other ranks."""

from __future__ import annotations

import threading
import time

from tardigrade_sdk import distributed


def coordinator_in_thread(port: int, n: int, timeout: float, attempt: int = 0,
                          check: distributed.Checker | None = None
                          ) -> tuple[threading.Thread, list[object]]:
    """Serve the rendezvous of job "job" until `n` ranks met or `timeout` passed; the list
    gets "ok" or the exception it ended with."""
    result: list[object] = []

    def run() -> None:
        try:
            distributed._serve_rendezvous(
                port, {"job": "job", "attempt": attempt, "num_processes": n}, n,
                time.monotonic() + timeout, check)
            result.append("ok")
        except Exception as err:
            result.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result
