"""Restart in place, the trainer's side: refuse a stale world, and take the operator's request
to save and restart.

A kept pod's container is started again by its kubelet (restart rule on exit 77) and reads
its new world from `TARDIGRADE_WORLD` (contract.py). The kubelet resolves that variable from
its own copy of the pod, which may lag the operator's annotation write; a container that
comes up with the world it already ran must not train a second time in it. The attempt it last
ran is kept in a directory that outlives the container (an emptyDir of the pod), and a world
that is not newer makes it exit 77 again: the kubelet starts it once more after its back-off,
by when the new world has arrived.

The operator's word comes as `POST /restart-in-place?attempt=N` on each kept rank's progress
port (every rank serves it when restart in place is on), with the pod's restart key as a bearer
token, once the pod's new world is written. The first rank to get it sends itself SIGTERM: the
preemption notice path (JAX's preemption sync manager, preemption.py) makes every rank agree on
one step and save it. A rank then waits for its own request (the proof that its world is
written; at most RELEASE_WAIT_SECONDS) and exits 77.
"""

from __future__ import annotations

import hmac
import os
import signal
import threading
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from tardigrade_trainer import contract

LAST_ATTEMPT_FILE = "last-attempt"
# The termination message of the last save this pod's trainer stopped after: a stale restart
# repeats it, so that the pod's lastState still tells the operator which step was saved.
LAST_EXIT_FILE = "last-exit.json"
# How long a rank that saved on notice waits for the operator's word before it exits 77 anyway:
# a preempted peer's notice reaches it before the operator has seen the preemption and written
# the new world; exiting before that would restart it on the old world, and the next restart
# comes only after the kubelet's 10 s back-off. Spent only by ranks whose pods go away.
RELEASE_WAIT_SECONDS = 5.0


class StaleWorld(RuntimeError):
    """The container was restarted with a world it already ran."""

    def __init__(self, why: str, saved: contract.TerminationMessage | None) -> None:
        super().__init__(why)
        self.saved = saved

    def termination(self, attempt: int) -> contract.TerminationMessage:
        """What this exit reports: the save it still stands on, else the refusal."""
        if self.saved is not None:
            return self.saved
        return contract.TerminationMessage(reason="StaleWorld", message=str(self),
                                           attempt=attempt)


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
        try:
            saved = contract.TerminationMessage.from_json(
                (path.parent / LAST_EXIT_FILE).read_text())
        except OSError:
            saved = None
        raise StaleWorld(f"this pod already ran attempt {last} and its world still says "
                         f"attempt {env.attempt}: waiting for the operator's new world", saved)
    partial = path.with_suffix(".partial")
    partial.write_text(str(env.attempt))
    os.replace(partial, path)


def remember_exit(env: contract.TrainerEnvironment,
                  message: contract.TerminationMessage) -> None:
    """Keep the message of a stop for restart in place (see LAST_EXIT_FILE)."""
    if not env.restart_in_place_dir:
        return
    path = Path(env.restart_in_place_dir) / LAST_EXIT_FILE
    partial = path.with_suffix(".partial")
    partial.write_text(message.to_json())
    os.replace(partial, path)


def stop_code(env: contract.TrainerEnvironment) -> tuple[int, str]:
    """Exit code and termination reason after a save on notice."""
    if env.restart_in_place_dir:
        return contract.EXIT_RESTART_IN_PLACE, "RestartInPlace"
    return contract.EXIT_PREEMPTED_SAVED, "PreemptedSaved"


class RestartRequests:
    """A rank's answer to the operator's `POST /restart-in-place?attempt=N`: 202, the notice
    (once), and the rank is released to restart into attempt N once its save is done."""

    def __init__(self, key: str | None, attempt: int = 0) -> None:
        self._key = key
        self._attempt = attempt
        self._noticed = False
        self.released = threading.Event()

    def handle(self, authorization: str | None, query: str = "",
               notice: Callable[[], None] | None = None) -> int:
        """`notice`: how the notice is given (a SIGTERM to this process by default)."""
        if not self._key:
            return 404  # restart in place is off for this pod
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                  self._key.encode()):
            return 401
        wanted = urllib.parse.parse_qs(query).get("attempt", [""])[0]
        if not wanted.isdigit() or int(wanted) <= self._attempt:
            return 400  # a request for this attempt or an older one: nothing to restart into
        self.released.set()
        if not self._noticed:
            self._noticed = True
            if notice is None:
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                notice()
        return 202

    def wait_released(self, seconds: float = RELEASE_WAIT_SECONDS) -> bool:
        """After the save: True once the operator has written this pod's new world (its
        request comes after that write); False after `seconds` (the pod is going away, or
        the operator recreates the gang): the rank stops anyway."""
        return self.released.wait(seconds)
