"""The check of a step used before it was traced: once the loop runs, the step is traced and
lowered beside it, and its program compared with the one the cache's entry was compiled from.

A warm relaunch loads its step from the cache by a key that names what determines the program
(step_cache.identity_key) and runs it without tracing first: tracing and lowering the 184M
reference step took 3.1 s of a TPU relaunch's start, and delayed the restore behind it. The key
cannot cover everything (a library's behaviour that changed without its version, an environment
variable nobody listed), so the program is still checked, only later: where it differs, the
lowered program is compiled and stored over the entry, and the loop swaps to it at the next
step (the steps before ran the stored program, and the `step_checked` line says so).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from tardigrade_trainer import step_cache


class ProgramCheck:
    """`lower()` traced and lowered in a thread of its own, its program compared with
    `expected` (the digest the entry was stored with); where they differ,
    `compile_again(lowered)` gives the step to run instead."""

    def __init__(self, lower: Callable[[], Any], expected: bytes,
                 compile_again: Callable[[Any], Any]) -> None:
        self.matches: bool | None = None
        self.replacement: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._done = threading.Event()

        def run() -> None:
            started = time.perf_counter()
            try:
                lowered = lower()
                self.matches = step_cache.program_digest(lowered.as_text()) == expected
                if not self.matches:
                    self.replacement = compile_again(lowered)
            except Exception as err:  # reported in the loop's log; the loop runs on
                self.error = err
            finally:
                self.seconds = time.perf_counter() - started
                self._done.set()

        threading.Thread(target=run, name="check-step", daemon=True).start()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()

    def fields(self) -> dict[str, Any]:
        """For the trainer's `step_checked` log line, once done."""
        found: dict[str, Any] = {"matches": self.matches, "seconds": round(self.seconds, 3)}
        if self.error is not None:
            found["error"] = f"{type(self.error).__name__}: {self.error}"
        elif not self.matches:
            found["detail"] = ("the stored step was compiled from another program than the one "
                               "lowered now: compiled again, stored, and run from the next step")
        return found
