"""One recovery protocol, two strategies: recreate the gang (recreate.py) or keep its healthy
pods and restart their trainers in place (in_place.py). Pure.

A strategy is chosen once per recovery (`choose`), when the recovery is recorded, and the
gang it launched is watched by the same kind (`watching`, read back from the recovery's
record, so an operator restarted part-way picks the same one). Its hooks, in the order a
recovery meets them:
- `begin`: stop what goes; returns what the launch that follows at once keeps (None: the
  relaunch waits for the old gang to exit);
- `rejoin`, `hold`, `finished_early`: every pass while the new gang comes back: the ranks to
  recreate after all, the ranks that do not count as running yet (and whether the restore
  step is still unknown), and a gang that finished its training before it formed;
- `settle`: once every rank runs again.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Protocol

from tardigrade_contract import contract

from tardigrade_operator.api.types import RecoveryCause, TrainingJobSpec, TrainingJobStatus
from tardigrade_operator.decision.nodeloss import node_watch
from tardigrade_operator.decision.plan import Plan
from tardigrade_operator.decision.recovery import in_place
from tardigrade_operator.decision.recovery.in_place import InPlace, InPlaceRecovery
from tardigrade_operator.decision.recovery.recreate import Recreate
from tardigrade_operator.decision.stage import launched_by
from tardigrade_operator.observation.observed import Observed
from tardigrade_operator.observation.pods import PodView, RankOutcome


class RecoveryStrategy(Protocol):
    def begin(self, plan: Plan, obs: Observed, gang: list[PodView],
              attempt: int) -> InPlaceRecovery | None: ...

    def rejoin(self, plan: Plan, obs: Observed, gang: list[PodView]) -> list[PodView]: ...

    def hold(self, outcomes: dict[int, RankOutcome], gang: list[PodView],
             status: TrainingJobStatus) -> bool: ...

    def finished_early(self, gang: list[PodView], outcomes: Mapping[int, RankOutcome],
                       status: TrainingJobStatus) -> PodView | None: ...

    def settle(self, plan: Plan, obs: Observed, gang: list[PodView]) -> None: ...


def pods_may_restart_in_place(obs: Observed, spec: TrainingJobSpec) -> bool:
    """Pods launched now may later restart in place (they get the job's restart key)."""
    return in_place.enabled(spec, obs.settings.restart_in_place)


def survivor_heartbeat(obs: Observed, spec: TrainingJobSpec) -> int | None:
    """JAX's heartbeat timeout for pods launched now (in_place.survivor_heartbeat_seconds)."""
    return in_place.survivor_heartbeat_seconds(spec, pods_may_restart_in_place(obs, spec),
                                               obs.settings.node_lost_after)


def choose(obs: Observed, spec: TrainingJobSpec, gang: list[PodView], cause: RecoveryCause,
           replicas: int, attempt: int) -> RecoveryStrategy:
    """The strategy of a recovery into `attempt`, chosen once, as it is recorded."""
    if pods_may_restart_in_place(obs, spec):
        kept = in_place.plan_recovery(gang, cause, replicas, node_watch(obs),
                                      obs.kubelet_versions, obs.job, attempt,
                                      memory_tier=spec.checkpoint.memory_tier is not None)
        if kept is not None:
            return InPlace(kept)
    return Recreate()


def watching(status: TrainingJobStatus) -> RecoveryStrategy:
    """The strategy of the recovery that launched the current attempt: in place when it kept
    pods (its record says so), else a recreation (a first launch counts as one)."""
    last = launched_by(status)
    return InPlace() if last is not None and last.kept_pods else Recreate()


def note_gang_formed(status: TrainingJobStatus, report: contract.ProgressReport | None,
                     now: datetime) -> None:
    """Record the first report of the last recovery's attempt (`gang_formed_time`): rank 0
    serves progress only once every rank met, so it is the one sign that kept ranks which
    restarted in process (no container restart) run the new world. A recovery that kept
    pods also learns its restore step there, and the steps lost: the newest step seen before
    it, past the restore. Call before the report is folded into `status.step`."""
    last = launched_by(status)
    if last is None or last.gang_formed_time is not None or report is None \
            or report.attempt != last.attempt:
        return
    last.gang_formed_time = now
    if last.kept_pods and last.restore_step is None:
        last.restore_step = report.restore_step or 0
        last.steps_lost = max(0, (status.step or 0) - last.restore_step)
