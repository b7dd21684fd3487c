"""What the handlers keep about one job between passes, in one object.

All of it is a cache: the cluster stays the truth, and an operator that starts without it
re-reads and decides the same (status is written before any action, decide.py).
"""

from __future__ import annotations

import asyncio
import dataclasses

from tardigrade_operator.api.types import TrainingJobSpec, TrainingJobStatus
from tardigrade_operator.indexlag import Created
from tardigrade_operator.keys import KeysCache
from tardigrade_operator.pacing import ProgressPoll
from tardigrade_operator.restart_in_place import CarryMemo


@dataclasses.dataclass
class JobState:
    # Set by any event about the job, its pods or their nodes: the loop passes at once.
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    # Set with `wake` by events that may change what the gang does (its pods, their nodes, a
    # new spec): rank 0 is read at the next pass and the back-off starts over. Not by other
    # job events, which are mostly the operator's own status writes: one that slips past
    # `echoes_our_write` (it can arrive before the write's answer) must not start a read, a
    # write and another echo.
    news: bool = False
    # Our last status write (resourceVersion, status), until the watch has caught up with it.
    written: tuple[str, TrainingJobStatus] | None = None
    # The spec parsed (and admission-checked) once per generation: (generation, spec, error).
    spec: tuple[int | None, TrainingJobSpec | None, str | None] | None = None
    # (generation, why the API server refused a child rendered from that generation)
    rejected: tuple[int, str] | None = None
    progress: ProgressPoll = dataclasses.field(default_factory=ProgressPoll)
    # The pods the last creating pass made: the index may not show them yet (indexlag.py).
    created: Created | None = None
    # Kept pods whose late label this operator sent (name -> attempt): the index shows the
    # patches seconds later at a thousand ranks, and the passes meanwhile must not send them
    # again (restart_in_place.late_labels).
    labelled: dict[str, int] = dataclasses.field(default_factory=dict)
    # The views restart_in_place.carried made, reused while the pod's view is the same.
    carried: CarryMemo = dataclasses.field(default_factory=dict)
    # (attempt, kept pods whose trainers did not take their restart request in it)
    refused: tuple[int, frozenset[str]] | None = None
    # What the operator last read of the job's keys Secret, and the keys (keys.py).
    keys: KeysCache | None = None

    def unsent(self, patches: list[tuple[str, dict]],
               attempt: int, present: set[str]) -> list[tuple[str, dict]]:
        """The patches not sent yet for this attempt; forgets pods no longer present."""
        self.labelled = {n: a for n, a in self.labelled.items() if n in present}
        return [(name, patch) for name, patch in patches if self.labelled.get(name) != attempt]

    def sent(self, patches: list[tuple[str, dict]], attempt: int) -> None:
        self.labelled.update((name, attempt) for name, _ in patches)

    def answered(self, attempt: int, asked: frozenset[str], refused: frozenset[str]) -> bool:
        """Note who of `asked` (kept pods asked to restart into `attempt`) did not take it;
        True when one did not that had not refused before (the next pass recreates it)."""
        known = self.refused[1] if self.refused is not None and self.refused[0] == attempt \
            else frozenset()
        now = (known - asked) | refused
        self.refused = (attempt, now) if now else None
        return bool(refused - known)

    def refused_in(self, attempt: int) -> frozenset[str]:
        """The refusals of this attempt; an older attempt's are forgotten."""
        if self.refused is None or self.refused[0] != attempt:
            self.refused = None
            return frozenset()
        return self.refused[1]

    def echoes_our_write(self, resource_version: str) -> bool:
        """The watch event carries the status this operator just wrote: nothing new."""
        return self.written is not None and self.written[0] == resource_version
