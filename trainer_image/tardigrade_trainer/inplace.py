"""Restart in place, the trainer's side: refuse a stale world, and take the operator's request
to save and restart.

A kept pod's container is started again by its kubelet (restart rule on exit 77) and reads
its new world from `TARDIGRADE_WORLD` (contract.py). The kubelet resolves that variable from
its own copy of the pod, which may lag the operator's annotation write; a container that
comes up with the world it already ran must not train a second time in it. The attempt it last
ran is kept in a directory that outlives the container (an emptyDir of the pod), and a world
that is not newer makes it exit 77 again: the kubelet starts it once more after its back-off,
by when the new world has arrived.

The request to restart comes from the operator as `POST /restart-in-place` on rank 0's
progress port, with the pod's restart key as a bearer token. Rank 0 then sends itself SIGTERM:
the preemption notice path (JAX's preemption sync manager, preemption.py) makes every rank
agree on one step, save it and stop, each with exit 77 because restart in place is on.
"""

from __future__ import annotations

import hmac
import os
import signal
from collections.abc import Callable
from pathlib import Path

from tardigrade_trainer import contract

LAST_ATTEMPT_FILE = "last-attempt"


class StaleWorld(RuntimeError):
    """The container was restarted with a world it already ran."""


def enter_world(env: contract.TrainerEnvironment) -> None:
    """Record the attempt this container runs as; StaleWorld when it is not newer than the
    last one run in this pod. A no-op unless restart in place is on."""
    if not env.restart_in_place_dir:
        return
    path = Path(env.restart_in_place_dir) / LAST_ATTEMPT_FILE
    try:
        last = int(path.read_text().strip())
    except (OSError, ValueError):
        last = None
    if last is not None and env.attempt <= last:
        raise StaleWorld(f"this pod already ran attempt {last} and its world still says "
                         f"attempt {env.attempt}: waiting for the operator's new world")
    partial = path.with_suffix(".partial")
    partial.write_text(str(env.attempt))
    os.replace(partial, path)


def stop_code(env: contract.TrainerEnvironment) -> tuple[int, str]:
    """Exit code and termination reason after a save on notice."""
    if env.restart_in_place_dir:
        return contract.EXIT_RESTART_IN_PLACE, "RestartInPlace"
    return contract.EXIT_PREEMPTED_SAVED, "PreemptedSaved"


class RestartRequests:
    """Rank 0's answer to the operator's POST: 202 and a save on notice, or why not."""

    def __init__(self, key: str | None) -> None:
        self._key = key

    def handle(self, authorization: str | None,
               notice: Callable[[], None] | None = None) -> int:
        """`notice`: how the notice is given (a SIGTERM to this process by default)."""
        if not self._key:
            return 404  # restart in place is off for this pod
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                  self._key.encode()):
            return 401
        if notice is None:
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            notice()
        return 202
