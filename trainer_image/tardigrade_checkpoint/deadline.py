"""A save's deadline: every wait of a save on notice is bounded by what is left of it.

A node shutdown gives a pod a fixed window between SIGTERM and SIGKILL (15 s on a GKE spot
reclaim). A save that is still waiting on storage when the window ends is killed half way,
and its rank exits without a termination message. So a save on notice gets a deadline (the
trainer derives it from the notice and the window, less a margin for leaving the gang):
each wait on storage, on a peer or on the previous save gives up when the deadline passes,
cancels what it waited for, and the save fails as `CheckpointDeadlineError` while there is
still time to say so. A missed deadline commits nothing: the previous commit stays the
newest.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Cancellable(Protocol):
    def result(self, timeout: float | None = None) -> Any: ...

    def done(self) -> bool: ...

    def cancel(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class Deadline:
    """An instant on this host's monotonic clock, and what it is for (for messages)."""

    at: float
    what: str = "the save's deadline"
    clock: Callable[[], float] = time.monotonic

    @classmethod
    def after(cls, seconds: float, what: str = "the save's deadline") -> Deadline:
        return cls(time.monotonic() + seconds, what)

    def remaining(self) -> float:
        return max(0.0, self.at - self.clock())

    def passed(self) -> bool:
        return self.clock() >= self.at


class DeadlineExceeded(TimeoutError):
    """What a bounded wait raises; the manager turns it into a CheckpointDeadlineError."""


def bounded(deadline: Deadline | None, limit: float) -> float:
    """The timeout for one wait: `limit`, or less if the deadline comes first."""
    return limit if deadline is None else min(limit, deadline.remaining())


def result(future: Cancellable, deadline: Deadline | None, doing: str) -> Any:
    """`future.result()`, cancelled and raising DeadlineExceeded if the deadline comes first.

    Works for TensorStore futures and `concurrent.futures.Future`s alike.
    """
    if deadline is None:
        return future.result()
    while True:
        try:
            return future.result(timeout=deadline.remaining())
        except (TimeoutError, concurrent.futures.TimeoutError):
            # Done: it failed with a TimeoutError of its own, or finished just after the wait
            # timed out; either way its own outcome is the answer.
            if future.done():
                return future.result()
            # Otherwise the wait timed out, and a timed wait can wake before the deadline on
            # this clock: TensorStore waits until an instant of the wall clock
            # (python/tensorstore/future.cc: `absl::Now() + timeout`, `sem_timedwait`), which
            # a clock step moves. So wait out the rest.
            if deadline.passed():
                break
    future.cancel()
    raise DeadlineExceeded(f"{doing} had not finished at {deadline.what}") from None


def unfinished(futures: Sequence[concurrent.futures.Future[Any]],
               deadline: Deadline | None) -> set[concurrent.futures.Future[Any]]:
    """The futures still running at the deadline (none, without one: it waits for all)."""
    while True:
        _, late = concurrent.futures.wait(futures, timeout=bounded(deadline, 1e9))
        if not late or deadline is None or deadline.passed():
            return late


def all_results(futures: Sequence[Cancellable], deadline: Deadline | None, doing: str) -> list[Any]:
    """Every future's result in order; on the deadline every one still running is cancelled."""
    try:
        return [result(f, deadline, doing) for f in futures]
    except DeadlineExceeded:
        for future in futures:
            future.cancel()
        raise
