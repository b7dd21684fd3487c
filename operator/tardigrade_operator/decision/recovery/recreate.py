"""The recovery that recreates the whole gang: every rank gets SIGTERM at once, so the gang
agrees on a step and saves inside its grace, and the relaunch follows once every old pod has
exited (decide.py, the teardown rung). The default, and the one for TPU slices, crashes,
retries and host maintenance."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tardigrade_operator.api.types import TrainingJobStatus
from tardigrade_operator.decision.plan import Plan, Trigger, requests_to, stop_all
from tardigrade_operator.observation.observed import Observed
from tardigrade_operator.observation.pods import PodView, RankOutcome


class Recreate:
    def begin(self, plan: Plan, obs: Observed, gang: list[PodView], attempt: int) -> None:
        stop_all(plan, obs, gang, grace=None)
        plan.restart_in_place = release_on_recreate(gang, attempt)

    def rejoin(self, plan: Plan, obs: Observed, gang: list[PodView]) -> list[PodView]:
        return []

    def hold(self, outcomes: dict[int, RankOutcome], gang: list[PodView],
             status: TrainingJobStatus) -> bool:
        return False

    def finished_early(self, gang: list[PodView], outcomes: Mapping[int, RankOutcome],
                       status: TrainingJobStatus) -> PodView | None:
        return None

    def settle(self, plan: Plan, obs: Observed, gang: list[PodView]) -> None:
        return None


def release_on_recreate(gang: Sequence[PodView], attempt: int) -> list[Trigger]:
    """The operator's word for the ranks of a gang it recreates whole (a recovery that keeps
    no pod). Trainers started for restart in place wait after their save on notice for this
    word before they exit (trainer inplace.release_deadline): told nothing, each would
    hold its pod, and the relaunch, that long. Their pods are being deleted, so their kubelet
    does not restart them: the word only lets them exit at once."""
    return list(requests_to([p for p in gang if p.active and not p.deleting], attempt))
