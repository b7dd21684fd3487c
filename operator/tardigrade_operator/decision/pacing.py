"""When a job's loop passes again, and when it reads rank 0's progress. Pure.

A pass is driven by events: the job's own changes, its pods' (the pod index), and readiness
or maintenance changes of the nodes its pods run on all wake it at once (handlers.py). Time
alone moves a decision only while something is under way (a launch, a teardown, a backoff, a
pod waiting for capacity or stuck terminating, a node not Ready): then the job is *busy* and
passes every `busy_seconds`, as every job did before. A *settled* job (its gang running, or
its end reached with nothing left running) waits for an event, a known deadline (growing back
after a capacity shrink), or its next progress read, whichever comes first.

Progress is read from rank 0 by the operator, never pushed by the pods. Pushing (the route
Kubeflow Trainer took: pods POST to a status server, authenticated with a projected service
account token that the controller reviews, kubeflow/trainer KEP-2779 and PR #3227) would
give every tenant's pods a way into the operator, a TokenReview per report, and a network
path that every job's NetworkPolicy must open; a pod annotation would need `patch pods` for
the tenant's service account, which RBAC cannot narrow to the pod itself, so one job could
write another's. Reading keeps the trust model of the contract: the operator picks the pod
(rank 0 of the attempt it launched, at the IP its kubelet reported) and validates what it
answers (contract.ProgressReport). To make a quiet job cheap the read backs off: the interval
doubles from `progress_min_seconds` to `progress_max_seconds` while the report brings nothing
the operator acts on (the step advancing is expected, not news), and starts over on any news
(a new checkpoint, a report appearing, vanishing or turning malformed) or event. A busy job
reads every `busy_seconds` and at an event, so node-loss judgements (progress in the last
minute) and the downtime of a recovery (the first step past the restore) see fresh reports;
but not twice within `READ_GAP_SECONDS`: a gang of a thousand pods restarting sends a
thousand events in seconds, and a read per pass was a status write per pass (the step).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

from tardigrade_contract import contract

from tardigrade_operator.api.types import TrainingJobStatus
from tardigrade_operator.decision.plan import Plan
from tardigrade_operator.decision.stage import Stage, launched_by, stage
from tardigrade_operator.observation.observed import Observed


@dataclasses.dataclass(frozen=True)
class PacingSettings:
    # How often a busy job passes (and reads progress): the old fixed resync.
    busy_seconds: float = 2.0
    progress_min_seconds: float = 2.0
    # The longest a settled job goes without a pass: also the bound on a missed event.
    progress_max_seconds: float = 60.0
    # Every job passes every busy_seconds and reads progress each time: the loop before
    # event-driven pacing, kept for the bench's baseline (TARDIGRADE_PACING=fixed).
    fixed: bool = False
    # Up to this fraction of an interval is taken off at random, so that jobs started together
    # (an operator restart) do not all read and write at the same moments ever after.
    jitter: float = 0.2


# The least time between two reads of one job's rank 0, however many events wake it.
READ_GAP_SECONDS = 1.0


# What of a report the operator acts on: whether there was one, its newest checkpoint, and
# why it was refused. The step is left out: it advances on every read of a training job.
ReportNews = tuple[bool, int | None, str | None]


def report_news(report: contract.ProgressReport | None, malformed: str | None) -> ReportNews:
    return (report is not None, report.checkpoint_step if report else None, malformed)


@dataclasses.dataclass(frozen=True)
class ProgressPoll:
    """When rank 0 is read next (on the loop's monotonic clock) and how long the wait was."""

    due: float = 0.0
    interval: float = 0.0
    news: ReportNews | None = None
    read_at: float = float("-inf")

    def is_due(self, now: float) -> bool:
        return now >= self.due

    def reset(self, now: float) -> ProgressPoll:
        """Something happened to the job: read at the next pass (or once READ_GAP_SECONDS
        have passed since the last read), and back off from scratch."""
        return dataclasses.replace(self, due=max(now, self.read_at + READ_GAP_SECONDS),
                                   interval=0.0)

    def after_read(self, now: float, news: ReportNews, busy: bool, settings: PacingSettings,
                   draw: float = 0.0) -> ProgressPoll:
        """The next read; `draw` in [0, 1) picks the jitter (random in the handler)."""
        if settings.fixed or busy or news != self.news or self.interval <= 0:
            interval = settings.progress_min_seconds
        else:
            interval = min(self.interval * 2, settings.progress_max_seconds)
        due = now + interval * (1 - settings.jitter * draw)
        return ProgressPoll(due=due, interval=interval, news=news, read_at=now)


def settled(obs: Observed, plan: Plan) -> bool:
    """True when nothing is under way that the clock alone could move on: the next decision
    needs an event, a progress read, or `next_deadline`."""
    if (plan.create_pods or plan.delete_pods or plan.release_pods
            or plan.create_service is not None or plan.create_network_policy is not None):
        return False
    status = plan.status
    if decided_anew(obs, plan):
        return False
    pods = obs.gang.pods
    where = stage(status)
    if where in (Stage.FINISHED, Stage.SUSPENDED):
        return not any(p.active for p in pods)
    if where is not Stage.RUNNING or status.phase != "Running":
        return False
    last = launched_by(status)
    if last is not None and last.downtime_seconds is None:
        return False  # the first step past the restore closes its downtime: read often
    ready = obs.nodes_ready or {}
    for pod in pods:
        if pod.deleting or pod.attempt != status.attempt:
            return False
        if pod.node_name and (ready.get(pod.node_name) is False
                              or pod.node_name in obs.nodes_maintenance):
            return False
    return True


def decided_anew(obs: Observed, plan: Plan) -> bool:
    """The pass changed what the next decision branches on (a recovery recorded, a phase or
    condition moved): the next pass, which builds on it, comes at once. Watch events of the
    operator's own status writes wake nobody, so this is what follows a write up."""
    return _standing(plan.status) != _standing(obs.status)


def _standing(status: TrainingJobStatus) -> tuple[object, ...]:
    """What of a status the decisions branch on; progress fields (step, loss) are left out,
    so a write that only records progress needs no pass after it."""
    return (status.phase, stage(status), status.attempt,
            tuple((c.type, c.status, c.reason) for c in status.conditions))


def next_deadline(obs: Observed, plan: Plan, grow_back_after: timedelta) -> datetime | None:
    """When a settled job's decision changes with time alone: a gang shrunk for capacity
    probes for it again (decide._grow_back)."""
    status, spec = plan.status, obs.spec
    limited = next((c for c in status.conditions if c.type == "CapacityLimited"), None)
    if (spec is None or limited is None or limited.status != "True"
            or status.replicas >= spec.replicas):
        return None
    return (limited.last_transition_time or obs.now) + grow_back_after


def seconds_to_next_pass(now: float, poll: ProgressPoll, busy: bool,
                         deadline_in: float | None, settings: PacingSettings,
                         again: bool = False) -> float:
    """How long the loop sleeps unless an event wakes it; `again`: decided_anew."""
    if settings.fixed:
        return settings.busy_seconds  # the echo of its own write woke the old loop
    if again:
        return 0.0
    wait = max(0.0, poll.due - now)
    if busy:
        return min(settings.busy_seconds, wait)
    if deadline_in is not None:
        wait = min(wait, max(0.0, deadline_in))
    return min(wait, settings.progress_max_seconds)
