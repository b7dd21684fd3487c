"""The condition types of a TrainingJob's status: what each means, and the summary ones.

`Ready`, `Reconciling` and `Stalled` are what platform tools read without knowing the kind:
kstatus (sigs.k8s.io/cli-utils pkg/kstatus/status, `checkGenericProperties`; used by Flux
health checks and `kubectl apply --prune` tooling) looks only at `Reconciling=True`
(in progress) and `Stalled=True` (failed), and `kubectl wait --for=condition=Ready` waits for
`Ready=True`. They follow from the phase and its reason alone, so this stays a pure table.
The catalog below is also what `docs/reference.md` renders.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from tardigrade_operator.api.types import Phase

ConditionStatus = Literal["True", "False", "Unknown"]

READY = "Ready"
RECONCILING = "Reconciling"
STALLED = "Stalled"
# The phase reason while a suspended gang is still saving and stopping (work in progress).
SUSPENDING = "Suspending"
# The phase reason (and CapacityLimited reason) while ranks cannot be placed and no node is
# on its way: nothing the operator does helps until capacity returns (a VM recreated, quota,
# an autoscaler that can grow), so kstatus tools see it as Stalled, not as work in progress.
WAITING_FOR_CAPACITY = "WaitingForCapacity"
# The phase reason (phase Queued) while a gang Kueue evicted is still saving and stopping.
EVICTING = "Evicting"

# Phases in which the job is where its spec wants it: training, or done.
_READY_PHASES: frozenset[str] = frozenset({"Running", "Succeeded"})
# Phases in which the operator is still bringing the gang to the spec.
_RECONCILING_PHASES: frozenset[str] = frozenset({"Pending", "Restarting", "Resizing"})
# Phases nothing but a user's change can leave.
_STALLED_PHASES: frozenset[str] = frozenset({"Failed"})


@dataclasses.dataclass(frozen=True)
class Summary:
    """One summary condition's value; the reason and message are the phase's."""

    type: str
    status: ConditionStatus
    reason: str
    message: str


def summary_conditions(phase: Phase, reason: str, message: str) -> list[Summary]:
    """Ready, Reconciling and Stalled for a job in `phase`, set for `reason`.

    Reconciling is True only while a gang is being (re)launched or stopped, never for a whole
    training run: Flux waits for it to turn False and times out otherwise.
    """
    stalled = phase in _STALLED_PHASES or reason == WAITING_FOR_CAPACITY
    reconciling = not stalled and (
        phase in _RECONCILING_PHASES or (phase == "Suspended" and reason == SUSPENDING)
        or (phase == "Queued" and reason == EVICTING))
    values = {
        READY: phase in _READY_PHASES,
        RECONCILING: reconciling,
        STALLED: stalled,
    }
    return [Summary(kind, "True" if value else "False", reason, message)
            for kind, value in values.items()]


@dataclasses.dataclass(frozen=True)
class ConditionDoc:
    type: str
    true_when: str
    false_when: str
    reasons: str


CATALOG: tuple[ConditionDoc, ...] = (
    ConditionDoc(
        READY,
        "the gang is training (phase Running) or the job has Succeeded",
        "the gang is launching, restarting, resizing or suspended, or the job Failed",
        "the phase's reason: `GangRunning`, `Completed`, `Launching`, `GangStarting`, "
        "`ContainerCannotStart`, `Preemption`, `Failure`, `Retry`, `NodeRejected` (a kubelet "
        "refused a pod: OutOf<resource>, NodeAffinity...), `Resize`, `Migration` (moving "
        "off a node with host maintenance scheduled), `BackOff`, "
        "`Suspending`, `Suspended`, `WaitingForPreviousJob` (a deleted job of the same name "
        "still has running pods or its Service), `WaitingForScaleUp` (a node autoscaler "
        "announced a node for an unschedulable rank: TriggeredScaleUp), `WaitingForCapacity` "
        "(see Stalled), or a failure reason (see Stalled)",
    ),
    ConditionDoc(
        RECONCILING,
        "the operator is bringing the gang to the spec: first launch, a relaunch after a "
        "preemption or failure (backoff included), a resize, a migration off host "
        "maintenance, or stopping a gang for "
        "`spec.suspend`",
        "the gang is training, suspended, or the job has finished; it does not stay True "
        "for a training run",
        "as for Ready",
    ),
    ConditionDoc(
        STALLED,
        "the job failed and only a change by a user helps, or it waits for capacity that "
        "nothing under way will bring (`WaitingForCapacity`, phase Pending: ranks unschedulable "
        "past the timeout, or the autoscaler answered NotTriggerScaleUp/FailedScaleUp, and "
        "minReplicas does not allow a smaller gang); it resumes by itself when nodes appear",
        "otherwise",
        "`WaitingForCapacity`, `InvalidSpec`, `PodRejected`, `CannotRun`, "
        "`RestartBudgetExhausted`, `RetryBudgetExhausted`, `PreemptionBudgetExhausted`, "
        "`ServiceNameTaken` (True); the phase's reason (False)",
    ),
    ConditionDoc(
        "Running",
        "every rank of the current attempt is running",
        "otherwise",
        "as for Ready; `Launching` marks a gang whose pods are being created",
    ),
    ConditionDoc(
        "Suspended", "`spec.suspend` is true and the gang is stopped or stopping", "otherwise",
        "`Suspending` (stopping after a save), `Suspended`; otherwise the phase's reason",
    ),
    ConditionDoc(
        "Succeeded", "every rank finished the run (`kubectl wait --for=condition=Succeeded`)",
        "never set False", "`Completed`",
    ),
    ConditionDoc(
        "Failed", "the job gave up (terminal)", "never set False",
        "`InvalidSpec`, `PodRejected`, `CannotRun`, `RestartBudgetExhausted`, "
        "`RetryBudgetExhausted`, `PreemptionBudgetExhausted`, `ServiceNameTaken` (a Service "
        "with the job's name is not the job's own)",
    ),
    ConditionDoc(
        "InvalidSpec", "the spec fails a check the API server cannot make (e.g. TPU slice "
        "size against replicas); the message names the field", "the spec is valid",
        "`SpecInvalid` (True), `Valid` (False)",
    ),
    ConditionDoc(
        "CapacityLimited", "the gang runs below spec.replicas (no capacity, elastic jobs), "
        "or waits for nodes to place its ranks",
        "the operator is growing back to spec.replicas, or the waiting gang got its nodes",
        "`Unschedulable` (shrunk), `WaitingForCapacity`, `GrowingBack`, `CapacityAvailable`",
    ),
)
