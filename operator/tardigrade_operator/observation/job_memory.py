"""What the handlers keep about one job between passes, in one object.

All of it is a cache: the cluster stays the truth, and an operator that starts without it
re-reads and decides the same (status is written before any action, decide.py).
"""

from __future__ import annotations

import asyncio
import dataclasses

from tardigrade_operator.api.types import TrainingJobSpec, TrainingJobStatus
from tardigrade_operator.decision.pacing import ProgressPoll
from tardigrade_operator.decision.recovery.in_place import InPlaceMemory
from tardigrade_operator.observation.indexlag import Created
from tardigrade_operator.rendering.keys import KeysCache


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
    # Restart in place's own memory (its strategy's state, in_place.InPlaceMemory).
    in_place: InPlaceMemory = dataclasses.field(default_factory=InPlaceMemory)
    # What the operator last read of the job's keys Secret, and the keys (keys.py).
    keys: KeysCache | None = None

    def echoes_our_write(self, resource_version: str) -> bool:
        """The watch event carries the status this operator just wrote: nothing new."""
        return self.written is not None and self.written[0] == resource_version
