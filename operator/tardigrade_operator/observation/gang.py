"""Whose pods are whose, and which of them form the gang: worked out once per pass. Pure.

The observation builds it (observe.py) and the decision reads it as it is: the pods of a
previous job of the same name are set aside, a pod kept by a restart in place counts in the
attempt it runs in (carry.carried), and a rank on a node that is shutting down is
seen as preempted now (pods.with_shutdown_notice).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tardigrade_operator.api.types import TrainingJobStatus
from tardigrade_operator.decision.recovery.carry import CarryMemo, carried
from tardigrade_operator.observation.pods import PodView, owned, with_shutdown_notice


@dataclasses.dataclass(frozen=True)
class Gang:
    # Pods labelled with the job's name but owned by another uid: a previous job of this name
    # (deleted, re-created). Never adopted, stopped, released or counted.
    previous: list[PodView]
    # This job's pods, every attempt, each in the attempt it runs in.
    pods: list[PodView]
    # The newest attempt: the status's, or a newer pod's when a status write was lost.
    attempt: int
    # The pods of `attempt`, by rank.
    current: list[PodView]


def gang_of(pods: Sequence[PodView], uid: str, status: TrainingJobStatus,
            shutting_down: frozenset[str] = frozenset(),
            memo: CarryMemo | None = None) -> Gang:
    """The job's gang from every pod labelled with its name. `memo` keeps the carried views
    between passes (carry.carried)."""
    previous = [p for p in pods if p.owner_uid != uid]
    mine = with_shutdown_notice(carried(owned(pods, uid), status, memo),
                                shutting_down)
    attempt = max([status.attempt, *(p.attempt for p in mine)])
    current = sorted((p for p in mine if p.attempt == attempt), key=lambda p: p.rank)
    return Gang(previous, mine, attempt, current)
