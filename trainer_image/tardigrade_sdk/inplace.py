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
token and the rank's new world (the annotation's JSON) as its body. The first rank to get it
sends itself SIGTERM: the preemption notice path (JAX's preemption sync manager,
preemption.py) makes every rank agree on one step and save it. The rank writes the world into
the pod's restart-in-place directory (WORLD_FILE), waits for its own request (until
`release_deadline`: a few seconds where its pod is being stopped, longer where its notice came
from a peer) and exits 77. The restarted container takes the newer of that file's
world and the env's (`newest_world`): the operator patches the kept pods' world annotation
only once the whole gang runs again.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path

from tardigrade_contract import contract
from tardigrade_contract.contract import PEER_NOTICE_RELEASE_WAIT_SECONDS

from tardigrade_sdk import bearer

LAST_ATTEMPT_FILE = "last-attempt"
# The termination message of the last save this pod's trainer stopped after: a stale restart
# repeats it, so that the pod's lastState still tells the operator which step was saved.
LAST_EXIT_FILE = "last-exit.json"
# The world the operator's restart request carried (contract.WORLD_KEYS JSON).
WORLD_FILE = "world.json"
# How long a rank that saved on notice waits for the operator's word before it exits 77 anyway:
# a preempted peer's notice reaches it before the operator has seen the preemption and
# sent the new world (in its request); exiting before that would restart it on the old world,
# and the next restart comes only after the kubelet's 10 s back-off. Spent only by ranks whose
# pods go away.
RELEASE_WAIT_SECONDS = 5.0
# The operator's word comes later in a bigger gang: its decision and its requests (one per
# rank, a bounded number at a time) grow with the ranks. At 1,024 simulated ranks on one
# loaded machine half the ranks had given up their 5 s before their request came, and each
# then met the back-off (git show a74afbd:docs/BENCHMARKS.md, "The world in the restart request").
RELEASE_WAIT_PER_RANK_SECONDS = 0.02
# Left of the shutdown window after the wait: the exit and its termination message.
EXIT_MARGIN_SECONDS = 1.0


def release_wait_seconds(num_processes: int, shutdown_window_seconds: float,
                         since_notice: float) -> float:
    """How long a rank whose pod is going away waits after its save for the operator's word:
    RELEASE_WAIT_SECONDS, more in a big gang; the part past RELEASE_WAIT_SECONDS never runs
    into the shutdown window's end (the pod would be killed, and its termination message,
    which says the step it saved, lost)."""
    wanted = RELEASE_WAIT_SECONDS + RELEASE_WAIT_PER_RANK_SECONDS * num_processes
    left = shutdown_window_seconds - since_notice - EXIT_MARGIN_SECONDS
    return max(0.0, min(wanted, max(RELEASE_WAIT_SECONDS, left)))


def release_deadline(saved_at: float, notice_at: float, own_notice_at: float | None,
                     num_processes: int, shutdown_window_seconds: float) -> float:
    """Until when (monotonic) a rank that saved at `saved_at` waits for the operator's word.
    `own_notice_at`: when the rank got a SIGTERM of its own (its pod is being stopped), None
    while its notice is a peer's; it moves as the SIGTERM comes, so call it again."""
    peer = saved_at + max(PEER_NOTICE_RELEASE_WAIT_SECONDS, release_wait_seconds(
        num_processes, shutdown_window_seconds, saved_at - notice_at))
    if own_notice_at is None:
        return peer
    going = release_wait_seconds(num_processes, shutdown_window_seconds,
                                 max(0.0, saved_at - own_notice_at))
    return min(peer, max(saved_at, own_notice_at) + going)


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


def newest_world(environ: Mapping[str, str]) -> Mapping[str, str]:
    """The environment with the newer of its own world and the one the operator's request left
    in the pod (WORLD_FILE), by attempt: the env's world lags until the kubelet has seen the
    operator's pod patch; the file lags when the kubelet restarts the container for a later
    attempt whose request never came (the patch did)."""
    folder = environ.get(contract.ENV_RESTART_IN_PLACE_DIR)
    if not folder:
        return environ
    try:
        text = (Path(folder) / WORLD_FILE).read_text()
        from_file = contract.parse_world(text, WORLD_FILE)
        attempt = int(from_file[contract.ENV_ATTEMPT])
    except (OSError, KeyError, ValueError):
        return environ  # none written (a first start), or unreadable: the env's world
    own = contract.parse_world(environ[contract.ENV_WORLD]) if environ.get(
        contract.ENV_WORLD) else {}
    current = own.get(contract.ENV_ATTEMPT, environ.get(contract.ENV_ATTEMPT) or "0")
    if current.isdigit() and int(current) >= attempt:
        return environ
    return {**environ, contract.ENV_WORLD: text}


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

    def __init__(self, key: str | None, attempt: int = 0, folder: str | None = None) -> None:
        """`folder`: the pod's restart-in-place directory, where a request's world is kept."""
        self._key = key
        self._attempt = attempt
        self._folder = folder
        self._noticed = False
        self._lock = threading.Lock()
        self.released = threading.Event()
        # The attempt of the newest world a request brought (None: none came, or none with a
        # world): what a rank restarting in process (attempts.py) starts into.
        self.world_attempt: int | None = None
        # Ranks the operator said were lost without notice (RESTART_LOST_RANKS_PARAM), once a
        # request brought them with a world; `after_answer` then calls `on_lost_ranks`.
        self.lost_ranks: tuple[int, ...] = ()
        self.on_lost_ranks: Callable[[tuple[int, ...]], None] | None = None
        self._lost_reported = False

    def answer(self, authorization: str | None, query: str = "", body: bytes = b"",
               notice: Callable[[], None] | None = None) -> tuple[int, str]:
        """The HTTP status and why. `body`: the rank's new world (empty: a rank whose pod goes
        away, told only to stop waiting). `notice`: how the notice is given (a SIGTERM to this
        process by default)."""
        if not self._key:
            return 404, "restart in place is off for this pod"
        if not bearer.matches(authorization, self._key):
            return 401, "the bearer token is not this pod's restart key"
        wanted = urllib.parse.parse_qs(query).get("attempt", [""])[0]
        if wanted.isdigit() and int(wanted) == self._attempt:
            # The operator's retry of a request this rank took (its answer was lost or late)
            # reaching the restarted trainer: done already, and not a refusal, which would
            # make the operator recreate a rank that runs the new world.
            return 200, f"this rank already runs attempt {self._attempt}"
        if not wanted.isdigit() or int(wanted) <= self._attempt:
            # A request for this attempt or an older one: nothing to restart into.
            return 400, f"attempt={wanted!r}: must be an attempt after {self._attempt}"
        if len(body) > contract.MAX_WORLD_BYTES:
            return 413, f"the world is over {contract.MAX_WORLD_BYTES} bytes"
        lost = parse_lost_ranks(query)
        if lost is None:
            return 400, (f"{contract.RESTART_LOST_RANKS_PARAM}= must be comma-separated rank "
                         "numbers")
        if body:
            refused = self._keep_world(body, int(wanted))
            if refused:
                return 400, refused
        self.released.set()
        if lost and body:
            # No save on notice can commit without the lost ranks, and this rank's loop waits
            # in a collective that will never complete: it restarts at once (after_answer).
            with self._lock:
                self.lost_ranks = lost
            return 202, f"ranks {', '.join(map(str, lost))} lost: restarting without a save"
        with self._lock:
            first, self._noticed = not self._noticed, True
        if first:
            if notice is None:
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                notice()
        return 202, ""

    def after_answer(self) -> None:
        """Called once the answer is on its way: a rank told of lost ranks leaves now
        (`on_lost_ranks`), and only once."""
        with self._lock:
            lost, report = self.lost_ranks, not self._lost_reported and bool(self.lost_ranks)
            self._lost_reported = self._lost_reported or report
        if report and self.on_lost_ranks is not None:
            self.on_lost_ranks(lost)

    def _keep_world(self, body: bytes, attempt: int) -> str:
        """Check the request's world and write it for the restarted container; why not, or ""."""
        try:
            text = body.decode()
            world = contract.parse_world(text, "the request's world")
        except UnicodeDecodeError:
            return "the request's world is not UTF-8 JSON"
        except contract.ContractError as err:
            return str(err)
        if world.get(contract.ENV_ATTEMPT) != str(attempt):
            return (f"the request's world.attempt={world.get(contract.ENV_ATTEMPT)!r} is not "
                    f"the query's attempt={attempt}")
        if self._folder:
            path = Path(self._folder) / WORLD_FILE
            partial = path.with_suffix(f".{attempt}.partial")
            with self._lock:
                if _written_attempt(path) < attempt:  # a retry or a late older one: keep newest
                    partial.write_text(text)
                    os.replace(partial, path)
                self.world_attempt = max(self.world_attempt or 0, attempt)
        return ""

    def restarts_into_newer(self, env: contract.TrainerEnvironment) -> bool:
        """A request brought a world newer than the one this rank runs (kept for its next
        start): the rank is kept, and restarts in its pod."""
        return (env.restart_in_place_dir is not None and self.released.is_set()
                and self.world_attempt is not None and self.world_attempt > env.attempt)

    def restarts_in_process(self, env: contract.TrainerEnvironment) -> bool:
        """Whether this rank, released, starts its new world in process (attempts.py): restart
        in process is on and a request brought a world newer than the one it ran (written
        where the next attempt reads it, `newest_world`). Otherwise it exits 77."""
        return env.restart_in_process and self.restarts_into_newer(env)

    def wait_released_until(self, deadline: Callable[[], float],
                            clock: Callable[[], float] = time.monotonic,
                            poll_seconds: float = 0.1) -> bool:
        """After the save: True once the operator's request came (with this rank's new world,
        kept for the restarted container); False at `deadline()` (the pod is going away, or
        the operator recreates the gang): the rank stops anyway. The deadline is read again
        every `poll_seconds`: a SIGTERM of the rank's own during the wait brings it nearer
        (release_deadline)."""
        while True:
            left = deadline() - clock()
            if left <= 0:
                return self.released.is_set()
            if self.released.wait(min(poll_seconds, left)):
                return True


def parse_lost_ranks(query: str) -> tuple[int, ...] | None:
    """The lost ranks a request names (empty: none); None when the parameter is malformed."""
    values = urllib.parse.parse_qs(query).get(contract.RESTART_LOST_RANKS_PARAM, [])
    ranks: list[int] = []
    for part in ",".join(values).split(","):
        if not part:
            continue
        if not part.isdigit():
            return None
        ranks.append(int(part))
    return tuple(sorted(set(ranks)))


def _written_attempt(path: Path) -> int:
    try:
        return int(json.loads(path.read_text())["attempt"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1
