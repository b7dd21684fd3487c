"""Decide: (spec, status, observed gang, now) -> a plan. Pure and table-tested.

The status is a cache the operator writes before it acts: a relaunch is first recorded as a
`Recovery` whose `attempt` is the next attempt (counters bumped in the same write), then the
old gang is stopped, then the new one is created. Restarting the operator at any point
replays the same decision from the same observations, so nothing is counted or created twice.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

from tardigrade_contract import contract

from tardigrade_operator import naming
from tardigrade_operator.api.conditions import (
    SUSPENDING,
    WAITING_FOR_CAPACITY,
)
from tardigrade_operator.api.types import (
    MAX_IGNORED_REPORT_LENGTH,
    MAX_REASON_LENGTH,
    MAX_RECOVERY_HISTORY,
    CheckpointRef,
    Phase,
    Recovery,
    RecoveryCause,
    RestoreRequest,
    TrainingJobSpec,
    TrainingJobStatus,
)
from tardigrade_operator.decision import checkpoint_scope, goodput, kueue_gate
from tardigrade_operator.decision.gang_messages import quarter, ranks_running
from tardigrade_operator.decision.maintenance import MaintenanceWatch, avoid_until, pools_due
from tardigrade_operator.decision.nodeloss import NodeWatch, node_watch
from tardigrade_operator.decision.plan import (
    Event,
    Plan,
    condition,
    finish,
    force_if_stuck,
    restore_step,
    set_condition,
    set_phase,
    set_summary,
    stop_all,
)
from tardigrade_operator.decision.recovery import in_place
from tardigrade_operator.decision.recovery import strategy as strategies
from tardigrade_operator.decision.recovery.in_place import InPlaceRecovery
from tardigrade_operator.decision.stage import (
    LAUNCHING,
    TERMINAL_PHASES,
    Stage,
    launched_by,
    pending_recovery,
    stage,
)
from tardigrade_operator.observation.autoscaling import ScaleUpSignal
from tardigrade_operator.observation.observed import Observed
from tardigrade_operator.observation.pods import (
    Outcome,
    PodView,
    RankOutcome,
    classify,
)
from tardigrade_operator.rendering import slice_placement, tpu_layout
from tardigrade_operator.rendering.keys import build_keys_secret
from tardigrade_operator.rendering.manifests import GangLaunch, build_gang, build_service
from tardigrade_operator.rendering.netpolicy import build_network_policy


def decide(obs: Observed) -> Plan:
    """The ladder, one rung per concern, top to bottom; a rung that settles the pass ends it.

    1. Kueue's gate (kueue_gate.py): the rungs below see the spec Kueue lets run, and the
       plan reports Kueue's hold (a job without the queue label skips it);
    2. the spec: invalid, refused by the API server, or outside the admin's rules -> Failed;
    3. what the pods report: a newer attempt adopted, progress and checkpoints recorded, old
       attempts deleted, recorded pods released;
    4. an ended job stays ended; a previous job's children hold the name;
    5. the job's children that went missing are made again;
    6. by the job's stage (stage.py): the first launch; a recovery's teardown and relaunch;
       the running gang watched (recovery's return, disruptions, resizes, capacity,
       maintenance, status), each through its own module;
    7. the goodput account moves on with the status the pass writes (goodput.py).
    """
    if obs.queue is None:
        plan = _ladder(obs)
        plan.status.queue = None  # out of Kueue (or its label removed): no queue to report
    else:
        plan = kueue_gate.under_gate(obs, _ladder)
    # Where the job's time went, booked with the status this pass writes (goodput.py).
    plan.status.goodput = goodput.account_pass(obs, plan.status)
    return plan


def _ladder(obs: Observed) -> Plan:
    plan = _begin_pass(obs)
    if _spec_refused(plan, obs):
        return plan
    spec = obs.spec
    assert spec is not None
    gang = _fold_in_reports(plan, obs)
    job_stage = stage(plan.status)
    if job_stage is Stage.FINISHED:
        _stay_finished(plan, obs, gang)
        return plan
    first_launch = job_stage is Stage.NEW
    if _held_by_another(plan, obs, obs.gang.previous, first_launch):
        return plan
    _make_missing_children(plan, obs, spec)
    if first_launch:
        _first_launch(plan, obs, spec)
    elif job_stage in (Stage.RECOVERING, Stage.SUSPENDED):
        _tear_down_then_launch(plan, obs, spec, gang, pending_recovery(plan.status))
    else:
        _watch_running_gang(plan, obs, spec, gang)
    return plan


def _begin_pass(obs: Observed) -> Plan:
    status = obs.status.model_copy(deep=True)
    status.observed_generation = obs.generation
    status.selector = naming.job_selector(obs.job.name)
    if status.start_time is None:
        status.start_time = obs.now
    return Plan(status=status)


def _spec_refused(plan: Plan, obs: Observed) -> bool:
    """A spec that cannot run ends the job, its pods stopped; True when it did."""
    status = plan.status
    if obs.spec is None:
        stop_all(plan, obs, obs.gang.pods, grace=None)
        set_condition(status, obs, "InvalidSpec", "True", "SpecInvalid",
                      obs.spec_error or "invalid spec")
        finish(plan, obs, "Failed", "InvalidSpec", obs.spec_error or "invalid spec")
        return True
    if obs.rejected is not None and status.phase not in TERMINAL_PHASES:
        stop_all(plan, obs, obs.gang.pods, grace=None)
        finish(plan, obs, "Failed", "PodRejected",
               f"{obs.rejected}; fix the TrainingJob field it names, then delete and re-apply "
               "the job")
        return True
    outside_paths = checkpoint_scope.refusals(obs.spec, obs.job.namespace,
                                              obs.settings.checkpoint_path_prefix)
    if outside_paths:
        outside = "; ".join(outside_paths)
        stop_all(plan, obs, obs.gang.pods, grace=None)
        set_condition(status, obs, "InvalidSpec", "True", "CheckpointPathNotAllowed", outside)
        finish(plan, obs, "Failed", "CheckpointPathNotAllowed", outside)
        return True
    set_condition(status, obs, "InvalidSpec", "False", "Valid", "")
    return False


def _fold_in_reports(plan: Plan, obs: Observed) -> list[PodView]:
    """Fold what the pods and rank 0 report into the status; returns the current gang."""
    status = plan.status
    # Pods of an attempt newer than the status knows: a status write was lost; adopt them.
    current = obs.gang.attempt
    status.attempt = current
    gang = obs.gang.current
    _delete_old_attempts(plan, obs, current)
    strategies.note_gang_formed(status, obs.progress, obs.now)
    _record_progress(status, obs, gang)
    _note_malformed_progress(plan, obs)
    _release_recorded(plan, obs, current)
    return gang


def _stay_finished(plan: Plan, obs: Observed, gang: list[PodView]) -> None:
    status = plan.status
    stop_all(plan, obs, gang, grace=None)
    # A job that ended before the summary conditions existed gets them too.
    ended = condition(status, status.phase)
    if ended is not None:
        set_summary(status, obs, status.phase, ended.reason, ended.message)


def _make_missing_children(plan: Plan, obs: Observed, spec: TrainingJobSpec) -> None:
    """Level-triggered: whichever of the job's children went missing is made again, before
    any pod this pass creates."""
    if obs.keys_secret is None and obs.new_keys is not None:
        plan.create_keys_secret = build_keys_secret(obs.job, obs.new_keys)
    if obs.service is None:
        plan.create_service = build_service(obs.job)
    peers = obs.settings.network_peers
    policy_missing = obs.service is None if obs.network_policy is None else not obs.network_policy
    if peers is not None and spec.network_policy.enabled and policy_missing:
        plan.create_network_policy = build_network_policy(obs.job, peers)


def _first_launch(plan: Plan, obs: Observed, spec: TrainingJobSpec) -> None:
    if spec.suspend:
        set_phase(plan, obs, "Suspended", "Suspended", "suspended before the first launch")
        return
    # Pod names carry the attempt: start past a previous job's, whose pods may linger.
    attempt = 1 + max((p.attempt for p in obs.gang.previous), default=0)
    _launch(plan, obs, spec, attempt=attempt, replicas=spec.replicas)


# --------------------------------------------------------------------------- running gang ---


def _watch_running_gang(plan: Plan, obs: Observed, spec: TrainingJobSpec,
                        gang: list[PodView]) -> None:
    status = plan.status
    # The recovery that launched this gang watches it come back.
    returning = strategies.watching(status)
    recreated = returning.rejoin(plan, obs, gang)
    gang = [p for p in gang if p not in recreated]
    outcomes = {p.rank: classify(p, spec.failure_policy.retryable_exit_codes) for p in gang}
    restore_unknown = returning.hold(outcomes, gang, status)
    _judge_unready_nodes(outcomes, node_watch(obs), gang)
    if not restore_unknown:
        _note_recovered(status, obs)

    if spec.suspend:
        stop_all(plan, obs, gang, grace=None)
        set_phase(plan, obs, "Suspended", SUSPENDING, "stopping the gang after a save")
        plan.events.append(Event("Normal", "Suspending", "spec.suspend is true: stopping the gang"))
        return
    if len(gang) == status.replicas and all(
        o.outcome is Outcome.SUCCEEDED for o in outcomes.values()
    ):
        finish(plan, obs, "Succeeded", "Completed",
               f"all {status.replicas} ranks finished at step {status.step}")
        return
    done = returning.finished_early(gang, outcomes, status)
    if done is not None:
        # The pass after the finish stops the new ranks (Stage.FINISHED).
        step = done.termination.step if done.termination is not None else None
        finish(plan, obs, "Succeeded", "Completed",
               f"rank 0 ({done.name}) finished the training at step {step or status.step} "
               "before the ranks restarted in place")
        return

    missing = [r for r in range(status.replicas) if r not in outcomes]
    # A slice's followers are created once its leader is placed (slice_placement.to_create):
    # until the gang has run, a missing one is still to come, not lost.
    to_come = ([] if status.phase == "Running"
               else slice_placement.followers(spec, status.replicas, missing, obs.node_pools))
    if missing and stage(status) is not Stage.LAUNCHING:
        # A rank vanished (node deleted, pod garbage-collected) while the gang was training.
        to_come = [*to_come, *(p.rank for p in recreated)]
        for rank in (r for r in missing if r not in to_come):
            outcomes[rank] = RankOutcome(
                Outcome.PREEMPTED, f"{naming.pod_name(obs.job.name, status.attempt, rank)}: gone"
            )
        missing = to_come

    stopped = _first_disruption(outcomes)
    if stopped is not None:
        _handle_disruption(plan, obs, spec, gang, stopped)
        return
    if missing:
        # The operator stopped part-way through creating this gang (the ranks it did create
        # may be running already): finish the launch. The phase stays Launching until a pass
        # sees every rank, so an interrupted finish is finished again, not counted.
        until, pools = _maintenance_avoidance(obs, spec, launched_by(status))
        launch = GangLaunch(status.attempt, status.replicas, restore_step(status), until, pools,
                            restart_in_place=strategies.pods_may_restart_in_place(obs, spec),
                            restart_in_process=obs.settings.restart_in_process,
                            heartbeat_timeout_seconds=strategies.survivor_heartbeat(obs, spec))
        plan.create_pods = slice_placement.to_create(
            spec, status.replicas,
            [pod for pod in build_gang(obs.job, spec, launch)
             if int(pod["metadata"]["labels"][naming.LABEL_RANK]) in missing],
            {p.rank: p.node_name for p in gang}, obs.node_pools)
        if plan.create_pods and launch.restart_in_place:
            in_place.annotate(plan.create_pods, obs.job, in_place.coordinator_of(
                gang, obs.job, status.attempt), launch)
        if plan.create_pods:
            return
        # Only followers are missing, each waiting for its slice's leader to be placed: the
        # gang is watched as it is (capacity, shrinking by slices, resizes).
    if _resize_requested(status, spec):
        _begin_recovery(plan, obs, gang, "Resize", spec.replicas,
                        f"spec.replicas changed from {status.replicas} to {spec.replicas}")
        return
    if _migrate_before_maintenance(plan, obs, spec, gang):
        return
    if _shrink_for_capacity(plan, obs, spec, gang):
        return
    if _grow_back(plan, obs, spec, gang):
        return

    # Ranks that already finished count as up: the rest are finishing the last steps.
    running = sum(o.outcome in (Outcome.RUNNING, Outcome.SUCCEEDED) for o in outcomes.values())
    if running == status.replicas:
        if status.phase != "Running":
            plan.events.append(Event("Normal", "Running",
                                     f"attempt {status.attempt}: all {running} ranks running"))
        _capacity_found(status, obs)
        set_phase(plan, obs, "Running", "GangRunning",
                  ranks_running(status.attempt, running, status.replicas))
        returning.settle(plan, obs, gang)
    else:
        phase = status.phase if status.phase in ("Restarting", "Resizing") else "Pending"
        message = ranks_running(status.attempt, running, status.replicas)
        if _report_capacity(plan, obs, gang, phase, message):
            return
        stuck = next((p for p in gang if p.waiting and not p.deleting), None)
        if stuck is None:
            set_phase(plan, obs, phase, "GangStarting", message)
            return
        message += f"; {stuck.name} cannot start: {stuck.waiting}"
        running_condition = condition(status, "Running")
        if running_condition is None or running_condition.reason != "ContainerCannotStart":
            plan.events.append(Event("Warning", "ContainerCannotStart", message))
        set_phase(plan, obs, phase, "ContainerCannotStart", message)


def _migrate_before_maintenance(plan: Plan, obs: Observed, spec: TrainingJobSpec,
                                gang: list[PodView]) -> bool:
    """A rank's node (for a TPU slice: any node of its pool) has host maintenance scheduled
    within the lead time: save and relaunch elsewhere now, on the gang's terms, rather than lose
    the node under it."""
    watch = MaintenanceWatch(obs.nodes_maintenance, obs.now,
                             timedelta(seconds=spec.preemption.maintenance_lead_seconds),
                             obs.node_pools if slice_placement.is_exclusive(spec) else None)
    due = [p for p in gang if watch.due(p) is not None]
    if not due:
        return False
    _begin_recovery(plan, obs, gang, "Migration", plan.status.replicas, watch.describe(due))
    return True


def _maintenance_avoidance(obs: Observed, spec: TrainingJobSpec, recovery: Recovery | None
                           ) -> tuple[int | None, tuple[str, ...]]:
    """For every launch while a lead time is set: the epoch before which its nodes must have no
    maintenance (the launch's recorded time + the lead: the relaunch's recovery, or the job's
    start for its first gang), and, for TPU slices, the node pools with a node due before then."""
    lead = timedelta(seconds=spec.preemption.maintenance_lead_seconds)
    if lead <= timedelta(0):
        return None, ()
    recorded = recovery.time if recovery is not None else (obs.status.start_time or obs.now)
    until = avoid_until(recorded, lead)
    if not slice_placement.is_exclusive(spec) or obs.node_pools is None:
        return until, ()
    return until, tuple(pools_due(obs.nodes_maintenance, obs.node_pools, until))


def _first_disruption(outcomes: dict[int, RankOutcome]) -> RankOutcome | None:
    # A preemption explains the crashes of its peers (their collectives fail), so it wins.
    for kind in (Outcome.PREEMPTED, Outcome.REJECTED, Outcome.FATAL, Outcome.RETRYABLE,
                 Outcome.FAILED):
        for rank in sorted(outcomes):
            if outcomes[rank].outcome is kind:
                return outcomes[rank]
    return None


def _judge_unready_nodes(outcomes: dict[int, RankOutcome], nodes: NodeWatch,
                         gang: list[PodView]) -> None:
    """Ranks on nodes that are not Ready: lost (a preemption), or ridden out. A rank whose
    disruption is known (its pod's DisruptionTarget, its node shutting down) keeps that
    reason."""
    suspects = [p for p in gang if nodes.suspect(p) and not p.disruption]
    lost = [p for p in suspects if nodes.lost(p)]
    for pod in lost:
        outcomes[pod.rank] = RankOutcome(Outcome.PREEMPTED, nodes.describe(pod))
    if lost or not suspects:
        return
    # A peer that crashed while a node is out crashed on a broken collective: the node's
    # outage explains it, not the trainer.
    for rank, outcome in outcomes.items():
        if outcome.outcome in (Outcome.FAILED, Outcome.RETRYABLE):
            outcomes[rank] = RankOutcome(
                Outcome.PREEMPTED, f"{outcome.reason}; while {nodes.describe(suspects[0])}")
            return


def _handle_disruption(plan: Plan, obs: Observed, spec: TrainingJobSpec,
                       gang: list[PodView], stopped: RankOutcome) -> None:
    _forget_streaks_after_healthy_run(plan.status, obs, spec)
    verdict = _give_up(plan.status, spec, stopped)
    if verdict is not None:
        stop_all(plan, obs, gang, grace=None)
        finish(plan, obs, "Failed", *verdict)
        return
    cause: RecoveryCause = {Outcome.FAILED: "Failure", Outcome.PREEMPTED: "Preemption",
                            Outcome.REJECTED: "NodeRejected"}.get(stopped.outcome, "Retry")
    _begin_recovery(plan, obs, gang, cause, plan.status.replicas, stopped.reason)


def _give_up(status: TrainingJobStatus, spec: TrainingJobSpec,
             stopped: RankOutcome) -> tuple[str, str] | None:
    """(reason, message) when this disruption ends the job instead of restarting it."""
    policy = spec.failure_policy
    if stopped.outcome is Outcome.FATAL:
        return ("CannotRun",
                f"the trainer cannot run this spec, restarting would not help: {stopped.reason}")
    if stopped.outcome is Outcome.FAILED and status.restarts.failures >= policy.max_restarts:
        return ("RestartBudgetExhausted",
                f"failed after {status.restarts.failures} restarts "
                f"(failurePolicy.maxRestarts={policy.max_restarts}): {stopped.reason}")
    streak = status.restarts.consecutive_retries
    if stopped.outcome is Outcome.RETRYABLE and streak >= policy.max_retries:
        return ("RetryBudgetExhausted",
                f"retried {streak} times in a row without a gang running for "
                f"{policy.backoff_reset_seconds:g}s (failurePolicy.maxRetries="
                f"{policy.max_retries}): {stopped.reason}")
    budget = policy.max_preemptions
    if stopped.outcome is Outcome.PREEMPTED and budget is not None \
            and status.restarts.preemptions >= budget:
        return ("PreemptionBudgetExhausted",
                f"preempted {status.restarts.preemptions} times "
                f"(failurePolicy.maxPreemptions={budget}): {stopped.reason}")
    return None


def _resize_requested(status: TrainingJobStatus, spec: TrainingJobSpec) -> bool:
    if spec.replicas == status.replicas:
        return False
    limited = condition(status, "CapacityLimited")
    # Running short of spec.replicas on purpose (capacity) is not a resize request.
    return not (limited and limited.status == "True" and status.replicas < spec.replicas)


@dataclasses.dataclass(frozen=True)
class CapacityView:
    """The gang's unschedulable pods, by what is known about capacity for them."""

    # A node autoscaler is adding a node for these (TriggeredScaleUp within scale_up_wait).
    scaling_up: list[tuple[PodView, ScaleUpSignal]]
    # No capacity is coming: the autoscaler said no (NotTriggerScaleUp) or failed
    # (FailedScaleUp), or the pod stayed unschedulable past the timeout with no scale-up.
    unavailable: list[tuple[PodView, str]]


def capacity_view(obs: Observed, gang: list[PodView]) -> CapacityView:
    settings = obs.settings
    scaling_up: list[tuple[PodView, ScaleUpSignal]] = []
    unavailable: list[tuple[PodView, str]] = []
    # The autoscaler tells only the pods that triggered a scale-up; the ones it packed onto
    # the same upcoming nodes hear nothing. So a scale-up for any rank covers the rest, unless
    # the autoscaler said no to a rank itself.
    triggered = [s for p in gang if (s := obs.scale_up.get(p.name)) is not None
                 and s.in_progress(obs.now, settings.scale_up_wait)]
    gang_signal = max(triggered, key=lambda s: s.time, default=None)
    for pod in gang:
        since = pod.unschedulable_since
        if since is None or pod.node_name or pod.deleting:
            continue
        signal = obs.scale_up.get(pod.name) or gang_signal
        if signal is not None and signal.in_progress(obs.now, settings.scale_up_wait):
            scaling_up.append((pod, signal))
        elif signal is not None and not signal.triggered:
            unavailable.append((pod, f"{signal.reason}: {signal.message}"))
        elif signal is not None and signal.triggered:
            waited = int(settings.scale_up_wait.total_seconds())
            unavailable.append((pod, f"the node scale-up it triggered did not deliver within "
                                     f"{waited}s"))
        elif obs.now - since >= settings.unschedulable_timeout:
            waited = int(settings.unschedulable_timeout.total_seconds())
            unavailable.append((pod, f"unschedulable for {waited}s and no node scale-up under "
                                     "way"))
    return CapacityView(scaling_up, unavailable)


def _shrink_for_capacity(plan: Plan, obs: Observed, spec: TrainingJobSpec,
                         gang: list[PodView]) -> bool:
    status = plan.status
    if spec.min_replicas is None or status.replicas <= spec.min_replicas:
        return False
    view = capacity_view(obs, gang)
    # A node on its way is worth the (bounded) wait: a smaller gang trains slower for hours.
    if view.scaling_up or not view.unavailable:
        return False
    scheduled = sum(1 for p in gang if p.node_name)
    # A TPU gang shrinks by whole slices: a slice missing one host cannot form.
    target = max(spec.min_replicas, tpu_layout.whole_slice_hosts(spec.accelerator, scheduled))
    if target >= status.replicas:
        return False
    pod, why = view.unavailable[0]
    reason = (f"{len(view.unavailable)} pods cannot be placed ({pod.name}: {why}): "
              f"shrinking from {status.replicas} to {target} replicas")
    set_condition(status, obs, "CapacityLimited", "True", "Unschedulable", reason)
    _begin_recovery(plan, obs, gang, "Resize", target, reason)
    return True


def _report_capacity(plan: Plan, obs: Observed, gang: list[PodView], phase: Phase,
                     message: str) -> bool:
    """Say what the gang waits for when pods cannot be placed; True when it did."""
    view = capacity_view(obs, gang)
    status = plan.status
    if view.scaling_up:
        pod, signal = view.scaling_up[0]
        limit = int(obs.settings.scale_up_wait.total_seconds())
        # No clock in the message: it would change the status on every pass.
        since = signal.time.strftime("%Y-%m-%dT%H:%M:%SZ")
        set_phase(plan, obs, phase, "WaitingForScaleUp",
                  f"{message}; {pod.name} waits for a node scale-up triggered at {since} "
                  f"(for at most {limit}s): {signal.message}")
        return True
    if not view.unavailable:
        return False
    pod, why = view.unavailable[0]
    # Counted by quarter, and the example pod kept while the quarter holds: the count, the
    # first pod and the scheduler's node counts change on every pass while a gang drains.
    waiting = (f"{message}; waiting for capacity: "
               f"{quarter(len(view.unavailable), status.replicas)}/"
               f"{status.replicas} pods cannot be placed (")
    text = f"{waiting}{pod.name}: {why})"
    limited = condition(status, "CapacityLimited")
    if limited is not None and limited.status == "True" and \
            limited.reason == WAITING_FOR_CAPACITY and limited.message.startswith(waiting):
        text = limited.message
    if limited is None or limited.status != "True":
        plan.events.append(Event("Warning", WAITING_FOR_CAPACITY, text))
    set_condition(status, obs, "CapacityLimited", "True", WAITING_FOR_CAPACITY, text)
    set_phase(plan, obs, "Pending", WAITING_FOR_CAPACITY, text)
    return True


def _capacity_found(status: TrainingJobStatus, obs: Observed) -> None:
    """A gang that waited for capacity at full size got it: the condition ends."""
    limited = condition(status, "CapacityLimited")
    if limited is not None and limited.status == "True" and \
            limited.reason == WAITING_FOR_CAPACITY and status.replicas >= (
                obs.spec.replicas if obs.spec else 0):
        set_condition(status, obs, "CapacityLimited", "False", "CapacityAvailable",
                      f"all {status.replicas} ranks placed and running")


def _grow_back(plan: Plan, obs: Observed, spec: TrainingJobSpec, gang: list[PodView]) -> bool:
    status = plan.status
    limited = condition(status, "CapacityLimited")
    if not limited or limited.status != "True" or status.replicas >= spec.replicas:
        return False
    since = limited.last_transition_time or obs.now
    if obs.now - since < obs.settings.grow_back_after:
        return False
    reason = f"probing for capacity: growing from {status.replicas} to {spec.replicas} replicas"
    set_condition(status, obs, "CapacityLimited", "False", "GrowingBack", reason)
    _begin_recovery(plan, obs, gang, "Resize", spec.replicas, reason)
    return True


def _held_by_another(plan: Plan, obs: Observed, previous: list[PodView],
                     first_launch: bool) -> bool:
    """True when a previous job's children stop this pass: the job waits, or fails."""
    ns = obs.job.namespace
    taken = [
        ("Service", "service", obs.service, naming.service_name(obs.job.name),
         "ServiceNameTaken",
         "the ranks need a headless Service of that name to find each other"),
        # Never read a Secret someone else made: whoever made it knows its values.
        ("Secret", "secret", obs.keys_secret, naming.keys_secret_name(obs.job.name),
         "SecretNameTaken",
         "the job's keys (restart, progress, compilation cache) must be in a Secret of that "
         "name that only the operator made"),
    ]
    for kind, noun, child, name, reason, why in taken:
        if child is None or child.owner_uid == obs.job.uid:
            continue
        since = plan.status.start_time or obs.now
        if (first_launch and child.owner_uid is not None
                and obs.now - since < obs.settings.previous_service_wait):
            # Owned by a deleted job of this name: the garbage collector removes it shortly.
            set_phase(plan, obs, "Pending", "WaitingForPreviousJob",
                      f"{kind} {ns}/{name} belongs to a previous TrainingJob of this name "
                      f"({child.owner}); waiting for the garbage collector to delete it")
            return True
        stop_all(plan, obs, obs.gang.pods, grace=None)
        finish(plan, obs, "Failed", reason,
               f"{kind} {ns}/{name} exists and is not owned by this TrainingJob (owner: "
               f"{child.owner}); {why}. Delete it (kubectl delete {noun} -n {ns} {name}) or "
               "rename the job, then delete and re-apply the TrainingJob")
        return True
    running = [p for p in previous if p.active and (
        p.deletion_timestamp is None or obs.now < p.deletion_timestamp)]
    if first_launch and running:
        # They may still be saving to the same checkpoint path: two gangs must not both
        # write it. Bounded by their grace period once the garbage collector deletes them.
        names = ", ".join(p.name for p in running[:5])
        set_phase(plan, obs, "Pending", "WaitingForPreviousJob",
                  f"pods of a previous TrainingJob of this name are still running ({names}); "
                  "waiting for them to stop (delete them if they are not being deleted: "
                  f"kubectl delete pod -n {ns} {running[0].name})")
        return True
    return False


# ---------------------------------------------------------------------- recovery & launch ---


def _begin_recovery(plan: Plan, obs: Observed, gang: list[PodView], cause: RecoveryCause,
                    replicas: int, reason: str) -> None:
    """Record the relaunch (and count it) first; the gang is stopped next."""
    status = plan.status
    counters = status.restarts
    if cause == "Preemption":
        counters.preemptions += 1
    elif cause == "Failure":
        counters.failures += 1
    elif cause == "Retry":
        counters.retries += 1
        counters.consecutive_retries += 1
    elif cause == "NodeRejected":
        counters.rejections += 1
        counters.consecutive_rejections += 1
    elif cause == "Resize":
        counters.resizes += 1
    elif cause == "Migration":
        counters.migrations += 1
    counters.total = (counters.preemptions + counters.failures + counters.resizes
                      + counters.retries + counters.rejections + counters.migrations)
    status.recoveries = [*status.recoveries, Recovery(
        cause=cause, time=obs.now, attempt=status.attempt + 1,
        from_replicas=status.replicas, to_replicas=replicas,
        reason=reason[:MAX_REASON_LENGTH],
    )][-MAX_RECOVERY_HISTORY:]
    phase = "Resizing" if cause == "Resize" else "Restarting"
    set_phase(plan, obs, phase, cause, reason)
    plan.events.append(Event("Normal" if cause in ("Preemption", "Resize", "Migration")
                             else "Warning", cause, reason))
    assert obs.spec is not None
    strategy = strategies.choose(obs, obs.spec, gang, cause, replicas, status.attempt + 1)
    kept = strategy.begin(plan, obs, gang, status.attempt + 1)
    if kept is not None:
        # The kept ranks restart now: the launch of the rest cannot wait for them to exit.
        _launch(plan, obs, obs.spec, status.attempt + 1, replicas, status.recoveries[-1], kept)


def _tear_down_then_launch(plan: Plan, obs: Observed, spec: TrainingJobSpec,
                           gang: list[PodView], pending: Recovery | None) -> None:
    status = plan.status
    stop_all(plan, obs, gang, grace=None)
    nodes = node_watch(obs)
    gone = [p for p in gang if nodes.given_up(p)]
    # Their tracking is over: no kubelet will report them, and the finalizer would keep them.
    plan.release_pods.extend(p.name for p in gone if p.tracked and p.name not in plan.release_pods)
    if any(p.active and p not in gone for p in gang):
        return  # still saving; wait for every rank of the old gang to exit
    if pending is None:  # suspended
        if spec.suspend:
            set_phase(plan, obs, "Suspended", "Suspended", "suspended; the gang is stopped")
            return
        reason = ("Kueue admitted the Workload" if obs.queue is not None
                  else "spec.suspend is false again")
        status.recoveries = [*status.recoveries, Recovery(
            cause="Resume", time=obs.now, attempt=status.attempt + 1,
            from_replicas=0, to_replicas=spec.replicas, reason=reason,
        )][-MAX_RECOVERY_HISTORY:]
        pending = status.recoveries[-1]
    elif spec.suspend:
        set_phase(plan, obs, "Suspended", "Suspended", "suspended; the gang is stopped")
        return
    wait = relaunch_backoff_seconds(spec, status, pending.cause)
    ready_at = pending.time + timedelta(seconds=wait)
    if obs.now < ready_at:
        after = {"Failure": "a failure", "Retry": "a retryable exit",
                 "NodeRejected": "an admission rejection"}[pending.cause]
        set_phase(plan, obs, "Restarting", "BackOff",
                  f"restarting after {after} in {(ready_at - obs.now).total_seconds():.0f}s"
                  f" (backoff {wait:.0f}s): {pending.reason}")
        return
    limited = condition(status, "CapacityLimited")
    # The newest spec.replicas wins (a scale during a restart is folded in), unless the gang
    # was shrunk on purpose for lack of capacity.
    capacity_bound = limited is not None and limited.status == "True" and pending.to_replicas
    replicas = pending.to_replicas if capacity_bound else spec.replicas
    _launch(plan, obs, spec, attempt=pending.attempt, replicas=replicas, recovery=pending)


def backoff_seconds(spec: TrainingJobSpec, failures: int) -> float:
    policy = spec.failure_policy
    return min(policy.backoff_seconds * 2 ** max(0, failures - 1), policy.max_backoff_seconds)


def relaunch_backoff_seconds(spec: TrainingJobSpec, status: TrainingJobStatus,
                             cause: RecoveryCause) -> float:
    """How long a relaunch for `cause` waits after it was recorded (counters already bumped)."""
    policy, counts = spec.failure_policy, status.restarts
    if cause == "Failure":
        return backoff_seconds(spec, counts.failures)
    if cause == "Retry":
        streak = counts.consecutive_retries
    elif cause == "NodeRejected":
        # The first rejection relaunches at once (elsewhere, most likely); repeats back off.
        streak = counts.consecutive_rejections - 1
    else:
        return 0.0
    if streak < 1:
        return 0.0
    return min(policy.retry_backoff_seconds * 2 ** (streak - 1),
               policy.max_retry_backoff_seconds)


def _forget_streaks_after_healthy_run(status: TrainingJobStatus, obs: Observed,
                                      spec: TrainingJobSpec) -> None:
    """A gang that trained for backoffResetSeconds ends the retry and rejection streaks."""
    running = condition(status, "Running")
    if running is None or running.status != "True" or running.last_transition_time is None:
        return
    healthy = obs.now - running.last_transition_time
    if healthy >= timedelta(seconds=spec.failure_policy.backoff_reset_seconds):
        status.restarts.consecutive_retries = 0
        status.restarts.consecutive_rejections = 0


def _launch(plan: Plan, obs: Observed, spec: TrainingJobSpec, attempt: int, replicas: int,
            recovery: Recovery | None = None,
            kept: InPlaceRecovery | None = None) -> None:
    status = plan.status
    rollback = _rollback(spec, status, obs.job.uid, attempt)
    restore = restore_step(status)
    status.attempt = attempt
    status.replicas = replicas
    layout = tpu_layout.layout_for(spec.accelerator, replicas)
    status.slices = layout.slices if layout is not None else None
    restored = int(restore) if restore.isdigit() else None
    if recovery is not None and kept is not None:
        kept.record(recovery, replicas)
    elif recovery is not None:
        recovery.restore_step = restored
        if status.step is not None and restored is not None:
            recovery.steps_lost = max(0, status.step - restored)
        recovery.to_replicas = replicas
    if restored is not None:
        # Training resumes from the checkpoint: steps past it will be trained again.
        status.step = restored
    until, pools = _maintenance_avoidance(obs, spec, recovery)
    launch = GangLaunch(attempt=attempt, replicas=replicas, restore_step=restore,
                        avoid_maintenance_until=until, avoid_pools=pools, rollback=rollback,
                        restart_in_place=strategies.pods_may_restart_in_place(obs, spec),
                        restart_in_process=obs.settings.restart_in_process,
                        heartbeat_timeout_seconds=strategies.survivor_heartbeat(obs, spec))
    plan.create_pods = slice_placement.to_create(
        spec, replicas, build_gang(obs.job, spec, launch), {}, obs.node_pools)
    phase = "Pending" if recovery is None else (
        "Resizing" if recovery.cause == "Resize" else "Restarting")
    message = f"attempt {attempt}: launching {replicas} ranks, restoring {restore}"
    if kept is not None:
        message = kept.narrow(plan, obs.job, launch)
    set_phase(plan, obs, phase, LAUNCHING, message)
    plan.events.append(Event("Normal", "Launched", message))


def _rollback(spec: TrainingJobSpec, status: TrainingJobStatus, uid: str,
              attempt: int) -> RestoreRequest | None:
    """spec.checkpoint.restoreStep as a request the trainer applies once (by its id, unique
    across re-creations of the job). A new value resets the pin: the new line starts at that
    step, below the abandoned line's."""
    wanted = spec.checkpoint.restore_step
    if wanted is None:
        status.restore_request = None
        return None
    if status.restore_request is None or status.restore_request.step != wanted:
        status.restore_request = RestoreRequest(step=wanted, request=f"{uid}/a{attempt}")
        status.last_checkpoint = CheckpointRef(step=wanted)
    return status.restore_request


def _note_recovered(status: TrainingJobStatus, obs: Observed) -> None:
    """Close the downtime of the last recovery once the new gang trains past its restore."""
    if not status.recoveries:
        return
    last = status.recoveries[-1]
    if last.attempt != status.attempt or last.downtime_seconds is not None:
        return
    progress = obs.progress
    if progress is not None and progress.attempt in (None, status.attempt) \
            and progress.step > (last.restore_step or 0):
        last.downtime_seconds = round((obs.now - last.time).total_seconds(), 3)


# ------------------------------------------------------------------------------- helpers ---


def _record_progress(status: TrainingJobStatus, obs: Observed, gang: list[PodView]) -> None:
    """Fold what the trainer reported (progress endpoint, termination messages) into status."""
    progress = obs.progress
    if progress is not None:
        if status.step is None or progress.step > status.step:
            status.last_progress_time = obs.now
        status.step = max(status.step or 0, progress.step)
        status.total_steps = progress.total_steps or status.total_steps
        if progress.loss is not None:
            status.loss = progress.loss
        when = contract.parse_time(progress.checkpoint_time) or obs.now
        _note_checkpoint(status, progress.checkpoint_step, progress.checkpoint_path, when)
    for pod in gang:
        message = pod.termination
        if message is None:
            continue
        if message.step is not None:
            status.step = max(status.step or 0, message.step)
        _note_checkpoint(status, message.checkpoint_step, message.checkpoint_path, obs.now)


def _note_malformed_progress(plan: Plan, obs: Observed) -> None:
    """A malformed report is ignored; one Warning says so, not one per poll."""
    status = plan.status
    if obs.progress_error is None:
        if obs.progress is not None:
            status.ignored_progress_report = None
        return
    message = obs.progress_error[:MAX_IGNORED_REPORT_LENGTH]
    if status.ignored_progress_report is None:
        plan.events.append(Event("Warning", "MalformedProgressReport",
                                 f"{message}; its reports are ignored until a valid one comes"))
    status.ignored_progress_report = message


def _note_checkpoint(status: TrainingJobStatus, step: int | None, path: str | None,
                     when: datetime) -> None:
    known = status.last_checkpoint
    if step is not None and (known is None or step > known.step):
        status.last_checkpoint = CheckpointRef(step=step, path=path, time=when)


def _delete_old_attempts(plan: Plan, obs: Observed, current: int) -> None:
    """Pods of older attempts are garbage once a newer attempt exists (their reports are
    already folded into the status)."""
    for pod in obs.gang.pods:
        if pod.attempt >= current:
            continue
        if not pod.deleting:
            plan.delete_pods.append((pod.name, None))
        else:
            force_if_stuck(plan, obs, pod)


def _release_recorded(plan: Plan, obs: Observed, current: int) -> None:
    terminal_job = plan.status.phase in TERMINAL_PHASES
    nodes = node_watch(obs)
    for pod in obs.gang.pods:
        final = pod.terminal or pod.abandoned or (pod.attempt < current and nodes.given_up(pod))
        if pod.tracked and final and (pod.deleting or pod.attempt < current or terminal_job):
            plan.release_pods.append(pod.name)


