"""The plan a decision builds (with the restart requests it sends), and the few ways every
rule of it writes the plan and the status: stop pods, set a phase or a condition, end the
job. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from datetime import timedelta
from typing import Literal

from tardigrade_contract import contract

from tardigrade_operator.api.conditions import summary_conditions
from tardigrade_operator.api.types import (
    MAX_MESSAGE_LENGTH,
    Condition,
    Phase,
    TrainingJobStatus,
)
from tardigrade_operator.observation.observed import Observed
from tardigrade_operator.observation.pods import PodView


@dataclasses.dataclass(frozen=True)
class Trigger:
    """Ask a kept rank to save and restart into the new attempt (trainer
    keepers.RestartRequests). It carries no key: the handlers send the job's restart key,
    read from the job's Secret (keys.py), with it."""

    pod: str
    url: str
    world: str | None = None  # the rank's new world (`world`); None: its pod goes away


def requests_to(pods: Iterable[PodView], attempt: int,
                lost: Iterable[int] = ()) -> tuple[Trigger, ...]:
    """The restart requests for those of `pods` whose trainers take one (they hold the job's
    restart key), into `attempt`. `lost`: ranks gone without notice, named in the request
    (contract.RESTART_LOST_RANKS_PARAM): the kept ranks then restart without a save."""
    ranks = ",".join(str(r) for r in sorted(set(lost)))
    query = f"?attempt={attempt}" + (
        f"&{contract.RESTART_LOST_RANKS_PARAM}={ranks}" if ranks else "")
    return tuple(
        Trigger(p.name, f"http://{p.pod_ip}:{contract.DEFAULT_PROGRESS_PORT}"
                        f"{contract.RESTART_IN_PLACE_PATH}{query}")
        for p in pods if p.pod_ip and p.restart_keyed)


# A pod stuck terminating this long past its deadline (node gone, kubelet dead) is forced.
FORCE_DELETE_AFTER = timedelta(seconds=30)


@dataclasses.dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclasses.dataclass
class Plan:
    status: TrainingJobStatus
    # The job's keys Secret, made before anything that reads it (kube.py).
    create_keys_secret: dict | None = None
    create_service: dict | None = None
    create_network_policy: dict | None = None
    create_pods: list[dict] = dataclasses.field(default_factory=list)
    # (pod name, grace period seconds; None keeps the pod's own terminationGracePeriodSeconds)
    delete_pods: list[tuple[str, int | None]] = dataclasses.field(default_factory=list)
    # Pods whose final state is in `status` now: drop our finalizer (after the status write).
    release_pods: list[str] = dataclasses.field(default_factory=list)
    events: list[Event] = dataclasses.field(default_factory=list)
    # Restart in place: the requests that make the gang save and restart, each kept rank's
    # with its world (sent after the deletes); then (pod name, merge patch) for kept pods,
    # applied last (kube.py).
    patch_pods: list[tuple[str, dict]] = dataclasses.field(default_factory=list)
    restart_in_place: list[Trigger] = dataclasses.field(default_factory=list)


def stop_all(plan: Plan, obs: Observed, pods: list[PodView], grace: int | None) -> None:
    for pod in pods:
        if pod.active and not pod.deleting:
            plan.delete_pods.append((pod.name, grace))
        elif pod.active:
            force_if_stuck(plan, obs, pod)


def force_if_stuck(plan: Plan, obs: Observed, pod: PodView) -> None:
    deadline = pod.deletion_timestamp
    if deadline is not None and obs.now - deadline > FORCE_DELETE_AFTER:
        plan.delete_pods.append((pod.name, 0))


def finish(plan: Plan, obs: Observed, phase: Phase, reason: str, message: str) -> None:
    status = plan.status
    if status.phase != phase:
        plan.events.append(Event("Normal" if phase == "Succeeded" else "Warning", reason,
                                 message))
    status.phase = phase
    status.message = message[:MAX_MESSAGE_LENGTH]
    status.completion_time = status.completion_time or obs.now
    set_condition(status, obs, phase, "True", reason, message)
    set_condition(status, obs, "Running", "False", reason, message)
    set_summary(status, obs, phase, reason, message)


def set_phase(plan: Plan, obs: Observed, phase: Phase, reason: str, message: str) -> None:
    status = plan.status
    status.phase = phase
    status.message = message[:MAX_MESSAGE_LENGTH]
    set_condition(status, obs, "Running", "True" if phase == "Running" else "False", reason,
                  message)
    set_condition(status, obs, "Suspended",
                  "True" if phase in ("Suspended", "Queued") else "False", reason, message)
    set_summary(status, obs, phase, reason, message)


def set_summary(status: TrainingJobStatus, obs: Observed, phase: Phase, reason: str,
                message: str) -> None:
    for summary in summary_conditions(phase, reason, message):
        set_condition(status, obs, summary.type, summary.status, summary.reason,
                      summary.message)


def condition(status: TrainingJobStatus, kind: str) -> Condition | None:
    return next((c for c in status.conditions if c.type == kind), None)


def set_condition(status: TrainingJobStatus, obs: Observed, kind: str,
                  value: Literal["True", "False", "Unknown"], reason: str, message: str) -> None:
    existing = condition(status, kind)
    # metav1.Condition: lastTransitionTime moves only when status does. Built anew each time
    # so the model checks the reason (CamelCase) here, not the API server at the write.
    same = existing is not None and existing.status == value
    since = existing.last_transition_time if existing is not None and same else obs.now
    fresh = Condition(type=kind, status=value, reason=reason,
                      message=message[:MAX_MESSAGE_LENGTH],
                      last_transition_time=since, observed_generation=obs.generation)
    if same:
        status.conditions = [fresh if c.type == kind else c for c in status.conditions]
    else:
        status.conditions = [c for c in status.conditions if c.type != kind] + [fresh]


def restore_step(status: TrainingJobStatus) -> str:
    # One decision for every rank: the newest checkpoint the operator knows was committed.
    if status.last_checkpoint is not None:
        return str(status.last_checkpoint.step)
    return contract.RESTORE_LATEST
