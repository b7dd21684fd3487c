"""Kueue's rung of the decision: a job labelled kueue.x-k8s.io/queue-name runs only as Kueue
admits it (queueing.py has the protocol). Pure.

The rung wraps the rest of the ladder: the rungs below decide on the spec Kueue lets run
(suspended until admitted; once admitted, the admitted count and the flavors' node labels and
tolerations), and the plan they return then reports Kueue's hold: phase Queued with the
LocalQueue and Kueue's reason rather than the Suspended that holding amounts to, admission and
eviction as events.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tardigrade_operator.api.conditions import EVICTING, SUSPENDING
from tardigrade_operator.api.types import QueueStatus
from tardigrade_operator.decision import queueing
from tardigrade_operator.decision.plan import Event, Plan, condition, set_phase
from tardigrade_operator.observation.observed import Observed


def under_gate(obs: Observed, ladder: Callable[[Observed], Plan]) -> Plan:
    """`ladder` run under Kueue's hold on the job (`obs.queue`)."""
    gate = obs.queue
    assert gate is not None
    gated = obs if obs.spec is None else dataclasses.replace(
        obs, spec=queueing.gated_spec(obs.spec, gate))
    plan = ladder(gated)
    workload = gate.workload
    if gate.admitted and workload is not None and workload.topology is not None:
        # Placed by Kueue's Topology Aware Scheduling: created gated, ungated by Kueue.
        plan.create_pods = [queueing.topology_pod(pod, workload) for pod in plan.create_pods]
    _note_queue(plan, obs, gate)
    return plan


def _note_queue(plan: Plan, obs: Observed, gate: queueing.QueueGate) -> None:
    """A job Kueue holds shows phase Queued with the LocalQueue and Kueue's reason, not the
    Suspended that holding it amounts to; admission and eviction are events."""
    status = plan.status
    before = obs.status.queue
    workload = gate.workload
    # No queue to report for a job held for lacking one: phase, reason and message say it.
    status.queue = None if gate.queue_name_required_in is not None else QueueStatus(
        local_queue=gate.queue, workload=workload.name if workload else None,
        cluster_queue=workload.cluster_queue if workload and gate.admitted else None,
        admitted=gate.admitted,
        admitted_replicas=gate.held if workload and gate.admitted else None,
        growing_to=gate.replicas if gate.growing and not gate.resizing else None,
        message=(gate.grow_message() if gate.growing and not gate.resizing
                 else "" if gate.admitted and not gate.suspended else gate.waiting_message()))
    if (status.queue is not None and status.queue.growing_to is not None
            and (before is None or before.growing_to != status.queue.growing_to)):
        plan.events.append(Event("Normal", "GrowQueued", gate.grow_message()))
    user_suspended = obs.spec is not None and obs.spec.suspend
    if not user_suspended:
        # Stopping for Kueue is not the user's suspension: the Evicted event says why.
        plan.events = [e for e in plan.events if e.reason != "Suspending"]
    if status.phase == "Suspended" and not user_suspended:
        stopping = condition(status, "Running")
        reason = (EVICTING if stopping is not None and stopping.reason == SUSPENDING
                  and not gate.resizing else gate.reason())
        if obs.status.phase != "Queued" and not gate.evicted:
            plan.events.append(Event("Normal", "Queued", gate.waiting_message()))
        set_phase(plan, obs, "Queued", reason, gate.waiting_message())
    was_admitted = before is not None and before.admitted
    if gate.admitted and not was_admitted:
        assert workload is not None
        plan.events.append(Event("Normal", "Admitted", (
            f"Kueue admitted {workload.admitted_count} replicas in ClusterQueue "
            f"{workload.cluster_queue} (Workload {workload.name})")))
    if gate.evicted and was_admitted:
        evicted = workload.conditions["Evicted"] if workload else None
        plan.events.append(Event("Normal", "Evicted", (
            f"Kueue evicted Workload {workload.name if workload else ''}"
            f" ({evicted.reason if evicted else ''}: {evicted.message if evicted else ''}): "
            "the gang saves, stops and is requeued")))
