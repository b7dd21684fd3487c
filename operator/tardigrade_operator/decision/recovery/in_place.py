"""Restart in place on a recovery: keep the gang's healthy pods, restart their trainers into
the new world, recreate only the rest. Pure; decide.py calls it, the writer and the handlers
carry out what it puts in the plan.

The steps, in the order the plan is applied (kube.py, handlers.py):
1. the status write records the recovery and the new attempt (as for a recreation);
2. the pods that are not kept are deleted;
3. each kept rank gets the operator's request (`Trigger`) with its new world as the body: the
   first one to get it sends itself SIGTERM, which reaches every rank through JAX's preemption
   sync (as does the SIGTERM of a deleted pod or of a lost host); every rank saves the agreed
   step, keeps the world in its pod's directory, waits for its own request and exits 77, and
   the kubelet restarts the kept ones in their pods, where they read the world from the file;
4. the missing ranks are created (with the world as their annotation too: the coordinator may
   be a kept pod of an older name);
5. once every rank runs again, each kept pod gets one merge patch (`late_labels`): the new
   attempt in its label and the new world in its annotation (contract.ANNOTATION_WORLD),
   which the kubelet puts into the environment of a container it restarts later for another
   reason (until then the world file the request left is the newer one: trainer
   keepers.newest_world). Until its patch the operator counts a kept pod in the new attempt by
   the recovery's record (`carried`), not by its label. The patches wait because at a
   thousand ranks they are a thousand writes: sent during the recovery, they competed with
   the kubelets' status writes for the API server and delayed every rank's restart.
   A kept trainer is judged by its last termination (`restarted_into`), not by the label.
6. a kept rank that did not take its request (refused, or no answer after the retries) is
   recreated at the next pass, in the same attempt (`recreate_refused`): without its world it
   would restart into the one it already ran and be turned away as stale, and the gang could
   not form without a second recovery. Its old pod saves with the gang before it goes. Rank
   0's pod cannot be replaced (the other ranks' worlds name it): it is asked again at each
   pass while its trainer may still be waiting for its word (`ask_again`).
Which pods may stay is judged per pod and node (keepers.py). A pod that ends with 77 anyway
(its kubelet ignored the rule) counts as saved, and the next pass recreates its rank.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from tardigrade_contract import contract
from tardigrade_contract.contract import PEER_NOTICE_RELEASE_WAIT_SECONDS

from tardigrade_operator import naming
from tardigrade_operator.api.types import (
    Recovery,
    RecoveryCause,
    TrainingJobSpec,
    TrainingJobStatus,
)
from tardigrade_operator.decision.nodeloss import NodeWatch
from tardigrade_operator.decision.plan import (
    Event,
    Plan,
    Trigger,
    requests_to,
    restore_step,
    stop_all,
)
from tardigrade_operator.decision.recovery import keepers
from tardigrade_operator.decision.recovery.carry import CarryMemo, rank_ranges
from tardigrade_operator.decision.stage import launched_by
from tardigrade_operator.observation.observed import Observed
from tardigrade_operator.observation.pods import Outcome, PodView, RankOutcome, classify
from tardigrade_operator.rendering.manifests import GangLaunch, JobRef

# Recoveries that may keep pods: the others back off first (a crash, a retry) or must leave
# their nodes (host maintenance), so they recreate.
CAUSES: tuple[RecoveryCause, ...] = ("Preemption", "Resize")
# A container restart goes through the kubelet's crash-loop back-off (KEP-5307, "Unintended
# Restart Loops"): the first restart is immediate, a container that exits again before the
# back-off entry expires waits 10 s, then 20 s... The entry expires when the container last
# exited more than twice the maximum back-off (2 x 300 s) before (client-go
# util/flowcontrol/backoff.go, `hasExpired`, as kuberuntime_manager.go's doBackOff uses it). A
# pod restarted in place more recently is recreated: a new pod has no back-off.
BACK_OFF_MEMORY = timedelta(seconds=600)
# kube-controller-manager's --node-monitor-grace-period default (50 s since 1.32): a lost node
# turns Unknown this long after its kubelet's last Lease renewal, before the operator's
# `node_lost_after` starts counting (nodeloss.py).
NODE_MONITOR_GRACE = timedelta(seconds=50)
# The operator's passes and the requests' round trips after its verdict, with room for a
# loaded control plane.
SURVIVOR_REQUEST_MARGIN = timedelta(seconds=60)
# The DisruptionTarget reason of kube-controller-manager's taint eviction
# (pkg/controller/tainteviction).
TAINT_EVICTION = "DeletionByTaintManager"
# How long a kept rank 0 that did not take its request is asked again (`ask_again`).
ASK_AGAIN_FOR = timedelta(seconds=PEER_NOTICE_RELEASE_WAIT_SECONDS)


@dataclasses.dataclass(frozen=True)
class InPlaceRecovery:
    plan: keepers.InPlacePlan
    coordinator_pod: str  # the pod that holds rank 0 in the new world
    triggers: tuple[Trigger, ...]

    def record(self, recovery: Recovery, replicas: int) -> None:
        """The recovery's record: the kept trainers are about to save a newer step, so the
        restore and the steps lost are read from their exits later (`note_restore`)."""
        recovery.to_replicas = replicas
        recovery.kept_pods = len(self.plan.keep)
        recovery.recreated_ranks = rank_ranges(self.plan.create_ranks) or None

    def narrow(self, plan: Plan, job: JobRef, launch: GangLaunch) -> str:
        """The launch creates only the ranks that are not kept, and sends each kept rank its
        request with its new world; returns the launch's message."""
        ranks = set(self.plan.create_ranks)
        plan.create_pods = [p for p in plan.create_pods
                            if int(p["metadata"]["labels"][naming.LABEL_RANK]) in ranks]
        annotate(plan.create_pods, job, self.coordinator_pod, launch)
        plan.restart_in_place = with_worlds(
            self.triggers, self.plan.keep, job, self.coordinator_pod, launch)
        return (f"attempt {launch.attempt}: {len(self.plan.keep)} of {launch.replicas} ranks "
                f"restart in place, {len(ranks)} new, restoring {launch.restore_step} or the "
                "step they save")


def survivor_heartbeat_seconds(spec: TrainingJobSpec, restart_in_place: bool,
                               node_lost_after: timedelta) -> int | None:
    """JAX's heartbeat timeout for the gang's trainers (contract.ENV_HEARTBEAT_TIMEOUT_SECONDS),
    or None for JAX's default. A rank lost without notice stops heartbeating, and JAX's
    coordination service then aborts every rank (SIGABRT, exit 134): a survivor's pod would
    end, its memory tier with it. Where the memory tier is on and pods are kept, that abort
    must come after the operator's own verdict on the node (the node monitor's grace, then
    `node_lost_after`) and its request, which restarts the survivors in place instead."""
    if spec.checkpoint.memory_tier is None or not restart_in_place:
        return None
    verdict = NODE_MONITOR_GRACE + node_lost_after + SURVIVOR_REQUEST_MARGIN
    return int(verdict.total_seconds())


def enabled(spec: TrainingJobSpec, switched_on: bool) -> bool:
    # TPU hosts get their slice's worker list at creation (manifests._tpu_worker_env), which
    # a restarted container could not update: TPU gangs recreate.
    return switched_on and spec.accelerator.kind != "tpu"


def members(gang: Sequence[PodView], nodes: NodeWatch,
            kubelet_versions: Mapping[str, str],
            memory_tier: bool = False) -> list[keepers.Member]:
    """`memory_tier`: the pods hold the job's memory tier, which a new pod would not have: a
    pod is kept even through its kubelet's back-off (10 s for a second restart within ten
    minutes, doubling to at most 300 s), a shorter wait than retraining the steps since the
    bucket's last commit."""
    def backed_off(p: PodView) -> bool:
        if p.restart_count == 0 or memory_tier:
            return False
        last = p.last_finished_at
        return last is None or nodes.now - last < BACK_OFF_MEMORY

    def healthy(p: PodView) -> bool:
        if not p.active or p.deleting or not p.node_name or nodes.suspect(p):
            return False
        outcome = classify(p).outcome
        # Running, or already stopped with 77 and being restarted by its kubelet.
        return outcome is Outcome.RUNNING or (
            outcome is Outcome.PENDING and p.exit_code == contract.EXIT_RESTART_IN_PLACE)

    def can_restart(p: PodView) -> bool:
        if not p.restart_keyed or backed_off(p):
            return False
        if p.restart_in_process:
            # Its trainer restarts itself in process: no kubelet takes part, so any node's does. A
            # rank that exits 77 anyway ends its pod where the rule is missing or ignored, and
            # the next pass recreates it (pods.classify: a save, as exit 75).
            return True
        return p.restart_rule and keepers.version_supports_rules(
            kubelet_versions.get(p.node_name or "", ""))

    return [keepers.Member(p.name, p.rank, healthy(p), can_restart(p)) for p in gang]


def lost_without_notice(pod: PodView, nodes: NodeWatch) -> bool:
    """The rank's node stopped without a shutdown: judged lost by the operator, or its pod
    evicted by the taint manager while the node is not Ready (the unreachable taint's
    toleration may end first). Its trainer got no SIGTERM and saves nothing."""
    return nodes.lost(pod) or (pod.active and pod.disruption == TAINT_EVICTION
                               and nodes.down_for(pod) is not None)


def plan_recovery(gang: Sequence[PodView], cause: RecoveryCause, replicas: int,
                  nodes: NodeWatch, kubelet_versions: Mapping[str, str],
                  job: JobRef, attempt: int, memory_tier: bool = False
                  ) -> InPlaceRecovery | None:
    """What an in-place recovery to `attempt` does, or None: recreate the whole gang."""
    if cause not in CAUSES:
        return None
    chosen = keepers.plan(members(gang, nodes, kubelet_versions, memory_tier), replicas,
                          enabled=True)
    if not chosen.in_place:
        return None
    by_name = {p.name: p for p in gang}
    kept = [by_name[k.name] for k in chosen.keep]
    rank0 = next((p for p in kept if p.rank == 0), None)
    coordinator = rank0.name if rank0 is not None else naming.pod_name(job.name, attempt, 0)
    # The ranks that go are asked too: they save with the gang and then need not wait for a
    # word that would never come (their kubelet does not restart a pod being deleted).
    going = [by_name[name] for name in chosen.delete
             if by_name[name].active and not by_name[name].deleting]
    # Ranks on lost nodes got no notice and will save nothing: the kept ones are told, and
    # restart at once (their loops wait on the lost ranks), keeping their memory tier.
    lost = [p.rank for p in gang if lost_without_notice(p, nodes)]
    triggers = requests_to([*kept, *going], attempt, lost)
    if not any(t.pod in {p.name for p in kept} for t in triggers):
        # Nothing would make the kept trainers save and stop: recreate instead.
        return None
    return InPlaceRecovery(chosen, coordinator, triggers)


def with_worlds(triggers: Iterable[Trigger], keep: Iterable[keepers.Keep], job: JobRef,
                coordinator_pod: str, launch: GangLaunch) -> list[Trigger]:
    """The requests, each kept rank's carrying its new world: the rank restarts into it without
    waiting for its pod's patch (the ranks that go get none)."""
    ranks = {k.name: k.rank for k in keep}
    return [dataclasses.replace(t, world=world(job, coordinator_pod, launch, ranks[t.pod]))
            if t.pod in ranks else t for t in triggers]


def refused(triggers: Sequence[Trigger], accepted: Sequence[bool]) -> frozenset[str]:
    """The kept pods whose trainers did not take their world (the ranks that go need none)."""
    return frozenset(t.pod for t, took in zip(triggers, accepted, strict=True)
                     if t.world is not None and not took)


def recreate_refused(gang: Sequence[PodView], refused_pods: frozenset[str],
                     status: TrainingJobStatus) -> list[PodView]:
    """The kept pods to recreate because their trainers did not take the request: still
    carried into the attempt (not relabelled, not being deleted) and the gang not formed yet.
    Rank 0's stays: the other ranks' worlds name its pod as their coordinator, and a new pod
    would have another name (the recovery then goes on as before: its trainer waits for the
    word, and a gang that cannot form is recovered again)."""
    return [p for p in _refused_kept(gang, refused_pods, status) if p.rank != 0]


def ask_again(gang: Sequence[PodView], refused_pods: frozenset[str], status: TrainingJobStatus,
              job: JobRef, restore_step: str, now: datetime) -> list[Trigger]:
    """Kept rank 0's request once more when it did not take it, for as long as its trainer
    may still wait for the word after the gang's save (contract
    PEER_NOTICE_RELEASE_WAIT_SECONDS, counted here from the recovery's record, which
    comes no later than the save it follows by more than the operator's reaction)."""
    last = launched_by(status)
    if last is None or now - last.time > ASK_AGAIN_FOR:
        return []
    leader = [p for p in _refused_kept(gang, refused_pods, status) if p.rank == 0]
    launch = GangLaunch(status.attempt, status.replicas, restore_step)
    return [dataclasses.replace(t, world=world(job, t.pod, launch, 0))
            for t in requests_to(leader, status.attempt)]


def _refused_kept(gang: Sequence[PodView], refused_pods: frozenset[str],
                  status: TrainingJobStatus) -> list[PodView]:
    """The refused kept pods still carried into the attempt (not relabelled, not being
    deleted), while the gang has not formed."""
    if not refused_pods or not _forming_in_place(status):
        return []
    return [p for p in gang if p.name in refused_pods and p.label_attempt is not None
            and not p.deleting]


def _forming_in_place(status: TrainingJobStatus) -> bool:
    """The current attempt was launched by a recovery that kept pods, and its gang has not
    been seen formed yet."""
    last = launched_by(status)
    return last is not None and bool(last.kept_pods) and last.gang_formed_time is None


def world(job: JobRef, coordinator_pod: str, launch: GangLaunch, rank: int) -> str:
    """The annotation a rank's container reads its new world from (contract.WORLD_KEYS)."""
    host = f"{coordinator_pod}.{naming.service_name(job.name)}"
    return json.dumps({
        "attempt": launch.attempt, "numProcesses": launch.replicas, "processId": rank,
        "coordinatorAddress": f"{host}:{contract.DEFAULT_COORDINATOR_PORT}",
        "restoreStep": launch.restore_step}, sort_keys=True)


def annotate(pods: Iterable[dict[str, Any]], job: JobRef, coordinator_pod: str,
             launch: GangLaunch) -> None:
    """Give new pods their world: their static coordinator names a pod of this attempt,
    which does not exist when rank 0 was kept."""
    for pod in pods:
        rank = int(pod["metadata"]["labels"][naming.LABEL_RANK])
        pod["metadata"].setdefault("annotations", {})[contract.ANNOTATION_WORLD] = world(
            job, coordinator_pod, launch, rank)


def coordinator_of(gang: Sequence[PodView], job: JobRef, attempt: int) -> str:
    rank0 = next((p for p in gang if p.rank == 0 and not p.deleting), None)
    return rank0.name if rank0 is not None else naming.pod_name(job.name, attempt, 0)


def kept_patch(job: JobRef, coordinator_pod: str, launch: GangLaunch,
               rank: int) -> dict[str, Any]:
    """One merge patch per kept pod: joins the new attempt and carries its world."""
    return {"metadata": {
        "labels": {naming.LABEL_ATTEMPT: str(launch.attempt)},
        "annotations": {contract.ANNOTATION_WORLD: world(job, coordinator_pod, launch, rank)}}}


def late_labels(gang: Sequence[PodView], job: JobRef,
                status: TrainingJobStatus) -> list[tuple[str, dict[str, Any]]]:
    """The patches of the kept pods not yet labelled with the attempt they run in; sent once
    every rank runs again. Their world names the step the gang restored (the request's named
    the operator's pin, the newest commit at or before it)."""
    stale = [p for p in gang if p.label_attempt is not None]
    if not stale:
        return []
    last = launched_by(status)
    restored = last.restore_step if last is not None else None
    launch = GangLaunch(status.attempt, status.replicas,
                        str(restored) if restored is not None else contract.RESTORE_LATEST)
    coordinator = coordinator_of(gang, job, status.attempt)
    return [(p.name, kept_patch(job, coordinator, launch, p.rank)) for p in stale]


def _name_attempt(pod: PodView) -> int | None:
    parts = pod.name.rsplit("-", 2)
    if len(parts) == 3 and parts[1].startswith("a") and parts[1][1:].isdigit():
        return int(parts[1][1:])
    return None


def restarted_into(pod: PodView, attempt: int) -> bool:
    """A kept pod's trainer has stopped in the previous attempt and been started again."""
    last = pod.last_termination
    return (pod.last_exit_code == contract.EXIT_RESTART_IN_PLACE and last is not None
            and last.attempt is not None and last.attempt >= attempt - 1)


def hold_unrestarted(outcomes: dict[int, RankOutcome], gang: Sequence[PodView],
                     status: TrainingJobStatus) -> None:
    """A kept pod still running its old trainer (saving, about to exit 77 or to restart in
    process) is not a rank of the new gang yet: it counts as starting, not running, until its
    container restarted or the gang was seen formed in the new attempt."""
    attempt = status.attempt
    last = launched_by(status)
    if last is not None and last.gang_formed_time is not None:
        return
    for pod in gang:
        kept = _name_attempt(pod) not in (None, pod.attempt)
        if kept and outcomes.get(pod.rank, RankOutcome(Outcome.PENDING, "")).outcome \
                is Outcome.RUNNING and not restarted_into(pod, attempt):
            outcomes[pod.rank] = RankOutcome(Outcome.PENDING, "saving, to restart in place")


def finished_before_restart(gang: Sequence[PodView], outcomes: Mapping[int, RankOutcome],
                            status: TrainingJobStatus) -> PodView | None:
    """A kept rank 0 whose trainer exited 0 while the in-place recovery's gang had not been
    seen formed: the old gang trained its last step (rank 0 commits the final save before it
    exits), or the new one already did. Either way there is nothing left to train, and the new
    ranks would wait for a coordinator that is gone. Only rank 0 tells: another rank may exit
    before rank 0's commit, which a reclaim of rank 0 can still prevent."""
    if not _forming_in_place(status):
        return None
    leader = next((p for p in gang if p.rank == 0 and p.label_attempt is not None), None)
    if leader is None or outcomes.get(0) is None or outcomes[0].outcome is not Outcome.SUCCEEDED:
        return None
    return leader


def note_restore(status: TrainingJobStatus, gang: Sequence[PodView]) -> bool:
    """Fill in the step an in-place recovery restores (the one the kept trainers saved and
    report in their last termination message). True while it is not known yet: until then
    rank 0's progress may still be the old trainer's."""
    last = launched_by(status)
    if last is None or not last.kept_pods or last.restore_step is not None:
        return False
    saved = [p.last_termination for p in gang if p.last_termination is not None
             and p.last_exit_code == contract.EXIT_RESTART_IN_PLACE
             and p.last_termination.attempt == last.attempt - 1
             and p.last_termination.checkpoint_step is not None]
    if not saved:
        return True
    restore = max(m.checkpoint_step or 0 for m in saved)
    last.restore_step = restore
    last.steps_lost = max(0, max(m.step or 0 for m in saved) - restore)
    return False


class InPlace:
    """The recovery that keeps the gang's healthy pods and restarts their trainers into the
    new world (the steps in this module's docstring). `kept`: what this recovery keeps, when
    it begins one; None when it watches the gang an earlier one launched."""

    def __init__(self, kept: InPlaceRecovery | None = None) -> None:
        self.kept = kept

    def begin(self, plan: Plan, obs: Observed, gang: list[PodView],
              attempt: int) -> InPlaceRecovery | None:
        # Healthy pods stay; only the rest are stopped (their SIGTERM reaches every rank).
        assert self.kept is not None
        stop_all(plan, obs, [p for p in gang if p.name in self.kept.plan.delete], grace=None)
        return self.kept

    def rejoin(self, plan: Plan, obs: Observed, gang: list[PodView]) -> list[PodView]:
        status = plan.status
        recreated = recreate_refused(gang, obs.refused_restarts, status)
        if recreated:
            gang = [p for p in gang if p not in recreated]
            plan.delete_pods.extend((p.name, None) for p in recreated)
            plan.events.extend(Event(
                "Warning", "RestartInPlaceRefused",
                f"{p.name} did not take the request to restart in place: recreating rank "
                f"{p.rank}") for p in recreated)
        plan.restart_in_place = ask_again(
            gang, obs.refused_restarts, status, obs.job, restore_step(status), obs.now)
        return recreated

    def hold(self, outcomes: dict[int, RankOutcome], gang: list[PodView],
             status: TrainingJobStatus) -> bool:
        hold_unrestarted(outcomes, gang, status)
        return note_restore(status, gang)

    def finished_early(self, gang: list[PodView], outcomes: Mapping[int, RankOutcome],
                       status: TrainingJobStatus) -> PodView | None:
        return finished_before_restart(gang, outcomes, status)

    def settle(self, plan: Plan, obs: Observed, gang: list[PodView]) -> None:
        plan.patch_pods = late_labels(gang, obs.job, plan.status)


@dataclasses.dataclass
class InPlaceMemory:
    """What the operator keeps between passes about its restarts in place. A cache: lost, the
    next pass sends a late label again or recreates a refused rank a pass later."""

    # Kept pods whose late label this operator sent (name -> attempt): the index shows the
    # patches seconds later at a thousand ranks, and the passes meanwhile must not send them
    # again (`late_labels`).
    labelled: dict[str, int] = dataclasses.field(default_factory=dict)
    # The views carry.carried made, reused while the pod's view is the same.
    carried: CarryMemo = dataclasses.field(default_factory=dict)
    # (attempt, kept pods whose trainers did not take their restart request in it)
    refused: tuple[int, frozenset[str]] | None = None

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
