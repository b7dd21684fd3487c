"""Preemption notice: all hosts agree on one step at which to save, then stop.

Kubernetes sends SIGTERM to each pod of a preempted gang, possibly not all at once. In a
distributed run JAX's preemption sync manager (installed by `jax.distributed.initialize`)
makes `reached_preemption_sync_point` return True on every host at the same step once any
host's notice is in the coordination service; the trainer writes that notice itself the
moment SIGTERM arrives (`NoticeAnnouncer`). Without JAX's manager (plain single-process use) a
Python handler stands in.

The save must commit inside the window a node shutdown gives (`TARDIGRADE_SHUTDOWN_WINDOW_SECONDS`:
the kubelet's grace for regular pods, 15 s on a GKE spot reclaim). It gets a deadline: the
window, measured from the notice, less a margin for what comes after the save (the
termination message, leaving the gang) and for the notice itself being seen late (with JAX's
sync manager the notice time is the agreed step, not the SIGTERM). A save that cannot
commit by then fails cleanly, naming the deadline, instead of being killed half way.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils
from tardigrade_checkpoint.deadline import Deadline

from tardigrade_sdk.notice import NOTICE_KEY, NoticeGuard, announce, listen_for_sigterm

__all__ = ["NOTICE_KEY", "NoticeAnnouncer", "PreemptionWatcher", "save_deadline",
           "window_overrun"]

# The margin: a fifth of the window, at most 2 s (15 s window: the save has 13 s).
MARGIN_FRACTION = 0.2
MAX_MARGIN_SECONDS = 2.0


class NoticeAnnouncer:
    """Tell the gang of a SIGTERM at once. XLA's own SIGTERM notifier sets a flag that a thread
    of its reads once a second (preemption_notifier.cc, SigtermNotifier, kListenInterval), so
    every notice reached the other ranks 0-1 s late. Here the signal wakes a thread of ours
    (signal.set_wakeup_fd: Python's C-level handler writes the signal's number, whichever thread
    it lands on and whatever the main thread is doing) which writes the notice key itself, as
    XLA's notifier would. Replacing the handler silences XLA's notifier; the first writer wins
    and a second write of the key is refused, which is harmless."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.installed = False
        # time.monotonic() of this process's first SIGTERM (a peer's notice reaches it through
        # the coordination service instead, and sets nothing here).
        self.received_at: float | None = None
        # Not installed (off the main thread, or another holds the wakeup fd): the notice
        # stays XLA's notifier's.
        self.installed = listen_for_sigterm(self._own_notice)

    def _own_notice(self) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
        self.announce()

    def announce(self) -> None:
        announce(self._client)


class PreemptionWatcher:
    """`guard`: the session's notice guard (notice.py), which has owned SIGTERM since the
    session started; without one the watcher installs its own handler."""

    def __init__(self, guard: NoticeGuard | None = None) -> None:
        self._local = threading.Event() if guard is None else guard.noticed
        self._guard = guard
        self._calls = 0
        # time.monotonic() of the notice: the SIGTERM itself with the Python handler; with
        # JAX's (which gives no time) the agreed step, so the measured time is a lower bound.
        self.noticed_at: float | None = None
        self._uses_jax = (
            jax_distributed.global_state.client is not None
            and jax_distributed.global_state.preemption_sync_manager is not None
        )
        if guard is not None and guard.installed:
            return  # the guard announces a SIGTERM to the gang and times it
        if self._uses_jax:
            self.announcer = NoticeAnnouncer(jax_distributed.global_state.client)
        else:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self.noticed_at is None:
            self.noticed_at = time.monotonic()
        self._local.set()

    def seconds_since_notice(self) -> float:
        return 0.0 if self.noticed_at is None else time.monotonic() - self.noticed_at

    @property
    def own_notice_at(self) -> float | None:
        """When this process got a SIGTERM of its own (its pod is being stopped); None while
        its notice is only a peer's. Where that cannot be told apart (XLA's own notifier), the
        notice counts as its own: the shorter wait."""
        if self._guard is not None and self._guard.installed:
            return self._guard.received_at
        if self._uses_jax and self.announcer.installed:
            return self.announcer.received_at
        return self.noticed_at

    def should_stop(self, step: int) -> bool:
        """Call at every step on every host; True at the one agreed step to save and stop."""
        self._calls += 1
        if self._uses_jax:
            # Count calls, not steps (every host starts at the same step and calls once per
            # step, so the counts agree). JAX's counter starts at 0: with step numbers, a
            # notice that arrives before the first call (during a restore or compilation)
            # would set a sync point of 1, which a resumed run never reaches.
            reached = bool(multihost_utils.reached_preemption_sync_point(self._calls))
            if reached and self.noticed_at is None:
                self.noticed_at = self._guard_noticed_at() or time.monotonic()
            return reached
        if self._local.is_set() and self.noticed_at is None:
            self.noticed_at = self._guard_noticed_at() or time.monotonic()
        return self._local.is_set()

    def _guard_noticed_at(self) -> float | None:
        """When the guard saw the notice (its own SIGTERM or a peer's), a closer time than
        the agreed step's."""
        return self._guard.noticed_at if self._guard is not None else None


def window_overrun(seconds_used: float, window_seconds: float) -> str | None:
    """A warning when the save on notice took longer than a node shutdown allows, else None."""
    if seconds_used <= window_seconds:
        return None
    return (f"the save on notice took {seconds_used:.1f}s, more than the {window_seconds:g}s a "
            "node shutdown gives (spec.preemption.shutdownWindowSeconds): on a spot reclaim the "
            "rank is killed before it commits and the job resumes from the previous checkpoint; "
            "checkpoint more often (spec.checkpoint.interval) or save less state")


def save_deadline(noticed_at: float, window_seconds: float) -> Deadline:
    """When a save on notice must have committed, on this host's monotonic clock."""
    budget = window_seconds - min(MAX_MARGIN_SECONDS, MARGIN_FRACTION * window_seconds)
    return Deadline(noticed_at + budget,
                    f"the save-on-notice deadline ({budget:.1f}s after the notice, of the "
                    f"{window_seconds:g}s shutdown window)")
