"""A preemption notice at any moment of a rank's life, not only between two training steps.

Between steps the gang agrees on one step to save at (preemption.py: JAX's preemption sync
point). Before the first step there is nothing newer than the committed checkpoint to save,
and waiting for a step to agree on would spend the grace period on start-up, the restore and
compiling the step, which can take longer than the window. So from the session's start:

* SIGTERM is caught at once (before `jax.distributed` starts: the default action killed the
  rank, exit 143, with no termination message), by a thread that the signal wakes through
  `signal.set_wakeup_fd`, whatever the main thread is blocked in;
* the gang's fate before its first step is one write-once key of the coordination service:
  `stop` (a rank's notice came first) or `train` (process 0 writes it once every rank has met
  at the first step). Every rank watches that key; one that reads `stop` leaves at once, from
  whichever thread read it, with nothing to save. Since the service refuses to overwrite a
  key, every rank reads the same fate: no rank can be training while another has left;
* after `train`, a notice is the training loop's: it is written where JAX's sync manager
  listens, and the gang agrees on a step to save at (preemption.py). Not before: the manager
  would start computing a sync point no rank is going to reach, and its shutdown waits for
  that computation, which hung the gang's exit.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from tardigrade_checkpoint.coordination import Coordination

log = logging.getLogger(__name__)

# What JAX's sync manager listens for in the coordination service's key-value store: the
# preempted task's death time, RFC 3339 (xla/tsl preemption_sync_manager.cc,
# kPreemptionNoticeKey, parsed with absl::RFC3339_full).
NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"
TRAIN = "train"
STOP = "stop"
# How long one wait for a peer's notice lasts before the watcher looks whether training began.
_WATCH_SLICE_MS = 500
# A save on notice behind one that was in flight is started only with this much room: its
# estimate is the in-flight save's own time, and a save that misses the window loses more
# than it would have saved (the rank is killed half way; exit 74 at best).
SECOND_SAVE_MARGIN = 1.5


def _wake_only(signum: int, frame: FrameType | None) -> None:
    pass  # the work is done by the thread the wakeup fd woke


def listen_for_sigterm(on_sigterm: Callable[[], None]) -> bool:
    """Call `on_sigterm` from a thread of its own whenever SIGTERM arrives, at once, whatever
    the main thread is doing (a Python handler alone runs only between bytecodes of the main
    thread, which may sit in a long XLA call): the signal wakes a pipe (`set_wakeup_fd`) that
    the thread reads. False, and nothing installed, off the main thread or where someone else
    (an event loop) holds the wakeup fd."""
    if threading.current_thread() is not threading.main_thread():
        return False  # signals are the main thread's to set up
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        return False
    signal.signal(signal.SIGTERM, _wake_only)

    def listen() -> None:
        while True:
            try:
                woke = os.read(read, 64)
            except OSError:
                return
            if not woke:
                return
            if signal.SIGTERM in woke:
                on_sigterm()

    threading.Thread(target=listen, daemon=True, name="preemption-notice").start()
    return True


def fate_key(attempt: int) -> str:
    return f"tardigrade-notice-fate-{attempt}"


class NoticeGuard:
    """This rank's notice from the session's start on.

    `on_stop(phase)` is called once, from the thread that learnt that the gang stops before
    training (the signal's thread, the peer watcher, or the main thread in `begin_training`),
    and must not return (it ends the process)."""

    def __init__(self, attempt: int, on_stop: Callable[[str], None]) -> None:
        self._attempt = attempt
        self._on_stop = on_stop
        self._lock = threading.Lock()
        self._gang: Coordination | None = None
        self._connected = False
        self._client: Any = None
        self._fate: str | None = None
        self._settled = threading.Event()
        self.noticed = threading.Event()
        # What the rank is doing, for the termination message ("start-up", "restore", ...).
        self.phase = "start-up"
        # time.monotonic() of this process's own first SIGTERM, and of the first notice of
        # either kind (a peer's comes through the coordination service).
        self.received_at: float | None = None
        self.noticed_at: float | None = None
        self.installed = False
        # Where another holds the wakeup fd (an event loop), notices come only between steps,
        # through JAX's own notifier.
        self.installed = listen_for_sigterm(self._own_notice)

    # --- the process's own SIGTERM --------------------------------------------------------------

    def _own_notice(self) -> None:
        now = time.monotonic()
        with self._lock:
            first = self.received_at is None
            if first:
                self.received_at = now
            client = self._client
        if not first:
            return
        self._noticed(now)
        if self._react() and client is not None:
            announce(client)  # the gang trains: the loop's sync point takes the notice

    def _noticed(self, when: float) -> None:
        with self._lock:
            if self.noticed_at is None:
                self.noticed_at = when
        self.noticed.set()

    # --- the coordination service ---------------------------------------------------------------
    def connect(self, client: Any, gang: Coordination | None) -> None:
        """`jax.distributed` is up: `client` is its coordination client (None for a gang of
        one); `gang` its collectives (None for a gang of one). XLA's own SIGTERM handler,
        installed by `jax.distributed.initialize`, is replaced by ours again (it looks for the
        signal once a second; ours writes the notice at once)."""
        if self.installed:
            signal.signal(signal.SIGTERM, _wake_only)
        with self._lock:
            self._client = client
            self._gang = gang
            self._connected = True
        if gang is not None:
            threading.Thread(target=self._watch_fate, daemon=True,
                             name="preemption-peer-notice").start()

    def _watch_fate(self) -> None:
        """Until the gang's fate is settled: a peer's `stop` (or process 0's `train`)."""
        assert self._gang is not None
        client, key = self._gang.client, fate_key(self._attempt)
        while not self._settled.is_set():
            began = time.monotonic()
            try:
                fate = str(client.blocking_key_value_get(key, _WATCH_SLICE_MS))
            except Exception:  # not there yet (deadline), or the service is going
                if time.monotonic() - began < _WATCH_SLICE_MS / 2000:
                    self._settled.wait(_WATCH_SLICE_MS / 1000)  # an error at once: no spin
                continue
            with self._lock:
                self._fate = self._fate or fate
                fate = self._fate
            if fate == STOP:
                self._noticed(time.monotonic())
                self._settled.set()
                self._on_stop(self.phase)
            return

    # --- the gang's fate before its first step ----------------------------------------------------
    def _react(self) -> bool:
        """This rank's notice came: stop now unless the gang already trains (then True)."""
        if self._decide(STOP) == STOP:
            self._settled.set()
            self._on_stop(self.phase)
        return True

    def _decide(self, wanted: str) -> str:
        """The gang's fate: `wanted` if it is the first word, else the one that was."""
        with self._lock:
            if self._fate is not None:
                return self._fate
            gang = self._gang
            if gang is None:
                self._fate = wanted
                return wanted
        key = fate_key(self._attempt)
        try:
            gang.client.key_value_set(key, wanted)
            fate = wanted
        except Exception:  # the service refuses a second write: the first word stands
            fate = str(gang.client.blocking_key_value_get(key, 10_000))
        with self._lock:
            self._fate = fate
        return fate

    def begin_training(self, timeout_seconds: float) -> bool:
        """Every rank, before its first step: True when the gang trains (a later notice is
        the loop's), False when a notice came first (the caller stops with nothing to save).

        With several processes every rank meets here first, so that `train` is said only once
        every rank is past its restore and its step's compilation."""
        with self._lock:
            gang = self._gang
            settled = self._fate
        if settled is None and gang is not None:
            gang.barrier(f"tardigrade-notice-meet-{self._attempt}", timeout_seconds)
            if gang.process_id == 0:
                fate = self._decide(TRAIN)
            else:
                fate = str(gang.client.blocking_key_value_get(fate_key(self._attempt),
                                                               int(timeout_seconds * 1000)))
                with self._lock:
                    self._fate = self._fate or fate
                    fate = self._fate
        else:
            fate = self._decide(TRAIN)
        self._settled.set()
        return fate == TRAIN

    @property
    def connected(self) -> bool:
        """`connect` was called: a stop leaves with the gang."""
        return self._connected

    @property
    def training(self) -> bool:
        return self._fate == TRAIN

    def seconds_since_notice(self) -> float:
        return 0.0 if self.noticed_at is None else time.monotonic() - self.noticed_at


def announce(client: Any) -> None:
    """Write this process's notice where JAX's sync manager and the peers' guards look."""
    death_time = datetime.datetime.now(datetime.UTC).isoformat()
    try:
        client.key_value_set(NOTICE_KEY, death_time)
    except Exception as err:  # already announced by a peer, or the service is gone
        log.info("preemption notice not written (%s): a peer's notice stands", err)


def another_save_fits(left_seconds: float | None, estimate_seconds: float | None) -> bool:
    """After a notice found a save in flight and that save committed: whether a save of the
    newer agreed step also fits in what is left of the window (`left_seconds`; None: no
    deadline). `estimate_seconds`: what the committed save took (None: unknown, no second
    save)."""
    if estimate_seconds is None:
        return False
    if left_seconds is None:
        return True
    return left_seconds > SECOND_SAVE_MARGIN * estimate_seconds
