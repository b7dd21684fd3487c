"""Make the death of a watch stream visible.

kopf runs one task per watched resource ("watcher for ..."). What those decode is bounded
(apidecode.py), so no object the API server can store ends one; should one end anyway, kopf
1.45.2's orchestrator re-raises its failure and the operator exits, but kopf never restarts a
watcher and its liveness endpoint knows nothing of them: were one to end while the process
lives on, no job of that kind would be reconciled again behind a green /healthz. The probe in
handlers.py asks `dead_watchers` and fails /healthz, so the kubelet restarts the operator.
kopf keeps no public handle on its tasks, so a task factory remembers them (weakly).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Coroutine, Generator
from typing import Any

WATCHER_PREFIX = "watcher for "

_tasks: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()


def track_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Remember every task `loop` creates from now on (idempotent)."""
    previous = loop.get_task_factory()
    if getattr(previous, "_tardigrade_tracks", False):
        return

    def factory(loop: asyncio.AbstractEventLoop,
                coro: Coroutine[Any, Any, Any] | Generator[Any, None, Any],
                **kwargs: Any) -> asyncio.Task[Any]:
        if previous is not None:
            task = previous(loop, coro, **kwargs)
        else:
            task = asyncio.Task(coro, loop=loop, **kwargs)  # type: ignore[arg-type]
        _tasks.add(task)
        return task

    factory._tardigrade_tracks = True  # type: ignore[attr-defined]
    loop.set_task_factory(factory)  # type: ignore[arg-type]


def dead_watchers() -> list[str]:
    """Watch streams that ended other than by cancellation (which is how kopf stops them),
    with the reason: such a stream never delivers another event."""
    dead = []
    for task in list(_tasks):
        name = task.get_name()
        if not name.startswith(WATCHER_PREFIX) or not task.done() or task.cancelled():
            continue
        error = task.exception()
        dead.append(f"{name[len(WATCHER_PREFIX):]}: "
                    f"{type(error).__name__ if error else 'ended'}")
    return sorted(dead)
