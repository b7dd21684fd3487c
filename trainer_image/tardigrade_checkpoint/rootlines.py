"""The root's current line and who may commit to it, as read from storage.

Keeps the root record (rootrecord.py) as last read and the lines of committed markers (which
never change), and answers which committed steps make up the current line (lineage.py).
Process 0 of a starting gang claims the root (`open_root`) or starts a new line from a step
(`fork_root`); before every commit, `check_fence` refuses a gang that was taken over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tardigrade_checkpoint import rootrecord
from tardigrade_checkpoint.errors import CheckpointIOError, FencedError
from tardigrade_checkpoint.lineage import LEGACY_LINEAGE, MarkerLine, line_steps
from tardigrade_checkpoint.marker import CheckpointInfo
from tardigrade_checkpoint.rootstore import RootStore


class RootLines:
    def __init__(self, store: RootStore, on_event: Callable[[dict[str, Any]], None]) -> None:
        self.store = store
        self.on_event = on_event
        # Who commits (process 0, once `open_root` ran) and the root record as last read.
        self.identity: rootrecord.JobIdentity | None = None
        self.attempt = 0
        self._record: rootrecord.RootRecord | None = None
        self._record_loaded = False
        self._lines: dict[int, MarkerLine] = {}  # committed markers are immutable

    def root_record(self) -> rootrecord.RootRecord | None:
        if not self._record_loaded:
            self.reload_root()
        return self._record

    def reload_root(self) -> rootrecord.RootRecord | None:
        self._record = rootrecord.load(self.store.kv, self.store.root)[0]
        self._record_loaded = True
        return self._record

    def forget(self, step: int) -> None:
        """`step`'s marker is being replaced or deleted."""
        self._lines.pop(step, None)

    def _marker_line(self, step: int) -> MarkerLine:
        if step not in self._lines:
            self._lines[step] = self.store.read_info(step).line()
        return self._lines[step]

    def line_of(self, record: rootrecord.RootRecord | None, committed: list[int]) -> list[int]:
        """Of the `committed` steps, those on the current line of `record`, ascending."""
        markers = [self._marker_line(s) for s in committed]
        if record is None:
            return line_steps(markers, None, LEGACY_LINEAGE, None)
        return line_steps(markers, record.branches, record.lineage, record.fence)

    def line_steps(self) -> list[int]:
        return self.line_of(self.root_record(), self.store.list_steps()[0])

    def on_current_line(self, info: CheckpointInfo) -> bool:
        # Judged on `info` as read: reading the marker again could miss it, while process 0
        # deletes a step of an abandoned line that another host is looking at.
        self._lines[info.step] = info.line()
        return info.step in self.line_of(self.root_record(), [info.step])

    def _swap_record(self, change: Callable[[rootrecord.RootRecord | None],
                                            rootrecord.RootRecord]) -> rootrecord.RootRecord:
        kv, root = self.store.kv, self.store.root
        # `store` tells this gang's own write (landed, its answer lost, refused on retry) from
        # a rival's: only a rival's sends `change` round again, so a fork adds one branch.
        for _ in range(8):
            record, generation = rootrecord.load(kv, root)
            new = change(record)
            if rootrecord.store(kv, new, generation, root):
                self._record, self._record_loaded = new, True
                return new
        raise CheckpointIOError(f"{root}/{rootrecord.ROOT_FILE} keeps changing under us: "
                                "another gang is starting on the same checkpoint root")

    def open_root(self, identity: rootrecord.JobIdentity, attempt: int
                  ) -> rootrecord.RootRecord:
        self.identity, self.attempt = identity, attempt

        def claim(record: rootrecord.RootRecord | None) -> rootrecord.RootRecord:
            steps = self.line_of(record, self.store.list_steps()[0])
            return rootrecord.take_over(record, identity, attempt, steps[-1] if steps else -1,
                                        self.store.root)

        return self._swap_record(claim)

    def fork_root(self, step: int | None, request: str | None) -> rootrecord.RootRecord:
        parent = None if step is None else self.store.read_info(step).lineage

        def branch(record: rootrecord.RootRecord | None) -> rootrecord.RootRecord:
            if record is None:
                raise FencedError(f"{self.store.root} has no root record: open_root first")
            return rootrecord.fork(record, parent, step, request)

        record = self._swap_record(branch)
        self.on_event({"event": "checkpoint_line_started", "lineage": record.lineage,
                       "from_step": step})
        return record

    def commit_identity(self) -> dict[str, Any]:
        """The commit marker's lineage, attempt and owner fields."""
        record = self.root_record()
        identity = self.identity
        return {"lineage": record.lineage if record else LEGACY_LINEAGE,
                "attempt": self.attempt if identity else None,
                "owner": dataclasses.asdict(identity) if identity else None}

    def check_fence(self) -> None:
        """Before a commit: FencedError once a newer attempt (or a re-created job) took the
        root over. A gang cut off from the operator may still be running."""
        if self.identity is not None:
            current = rootrecord.load(self.store.kv, self.store.root)[0]
            rootrecord.check_fence(current, self.identity, self.attempt, self.store.root)
