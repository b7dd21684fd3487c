"""Waiting for a condition in tests: poll with a deadline, never a bare sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T | None], timeout: float = 30.0,
             what: str = "condition", interval: float = 0.05) -> T:
    """Poll until `predicate` returns something truthy; fail naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
