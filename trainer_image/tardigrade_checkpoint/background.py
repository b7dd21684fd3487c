"""The thread a manager's saves run on: one at a time, in order, and never in the way of exit.

`concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits. A save
stuck on storage that stopped answering (a periodic save that started before the notice,
with no deadline of its own) would then keep a rank that has already given up, and said so,
from exiting until the kubelet kills it. This thread is a daemon: a rank leaves when its
main thread is done, and an abandoned save stays uncommitted, which is what it is.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any


class SaveThread:
    """`submit(fn, *args)` -> Future, run in submission order on one daemon thread."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any],
                                             Callable[..., Any], tuple[Any, ...]] | None]
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # handed to whoever waits on the future
                future.set_exception(err)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self, wait: bool = True) -> None:
        self._queue.put(None)
        if wait:
            self._thread.join()
