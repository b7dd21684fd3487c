"""Retention: which committed and partial checkpoints process 0 deletes, and when.

After each commit the keep policy (policy.py) runs on a thread of its own, so that a save on
notice can stop it between two deletes instead of waiting behind it. It deletes the steps of
the current line the policy releases, committed steps of abandoned lines (or of fenced-off
gangs) older than the new commit, and partial step directories older than it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from tardigrade_checkpoint import layout
from tardigrade_checkpoint.faults import AFTER_GC, SaveFaults
from tardigrade_checkpoint.policy import KeepPolicy, deletable
from tardigrade_checkpoint.rootlines import RootLines
from tardigrade_checkpoint.rootstore import RootStore

log = logging.getLogger(__name__)


class Retention:
    def __init__(self, store: RootStore, lines: RootLines, keep: KeepPolicy,
                 on_event: Callable[[dict[str, Any]], None], faults: SaveFaults,
                 process_id: int) -> None:
        self.store = store
        self.lines = lines
        self.keep = keep
        self.on_event = on_event
        self.faults = faults
        self.process_id = process_id
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self, newest: int, after_save: bool = True) -> None:
        """Apply the keep policy up to `newest` in the background (process 0): after the save
        of `newest`, or (`after_save` false) at start-up, for the deletes a save on notice
        left undone."""
        self.join()  # one at a time; the previous one is done or stopping
        self._stop = threading.Event()
        stop = self._stop

        def run() -> None:
            self.collect(newest, stop)
            if after_save:
                self.faults.at(AFTER_GC, newest, self.process_id)

        # A daemon: a process leaving after a save on notice must not wait for deletes.
        self._thread = threading.Thread(target=run, name="checkpoint-retention", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the deletes in progress to end after the current one (a save on notice)."""
        self._stop.set()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def collect_partials(self, below: int | None = None) -> list[int]:
        """Delete partial checkpoints (all, or those older than `below`)."""
        _, partial = self.store.list_steps()
        doomed = [s for s in partial if below is None or s < below]
        for step in doomed:
            self.store.delete_dir(layout.step_dir(step))
            self.on_event({"event": "checkpoint_partial_removed", "step": step})
        return doomed

    def collect(self, newest: int, stop: threading.Event) -> list[int]:
        """Apply the keep policy up to `newest`; `stop` ends it between two deletes."""
        deleted = []
        try:
            committed, _ = self.store.list_steps()
            line = self.lines.line_of(self.lines.root_record(), committed)
            for step in deletable(self.keep, [s for s in line if s <= newest]):
                if stop.is_set():
                    return deleted
                self._delete(step)
                deleted.append(step)
                self.on_event({"event": "checkpoint_deleted", "step": step})
            # Steps of abandoned lines (or of fenced-off gangs) older than this commit can
            # never become the newest of the current line again.
            for step in sorted(set(committed) - set(line)):
                if stop.is_set():
                    return deleted
                if step < newest:
                    self._delete(step)
                    deleted.append(step)
                    self.on_event({"event": "checkpoint_abandoned_removed", "step": step})
            if not stop.is_set():
                self.collect_partials(below=newest)
        except Exception as err:  # cleanup is best effort; the next commit retries it
            log.warning("checkpoint garbage collection failed: %s", err)
        return deleted

    def _delete(self, step: int) -> None:
        self.store.delete_dir(layout.step_dir(step))
        self.lines.forget(step)
