"""Kueue admission for TrainingJobs: pure functions, table-tested without a server.

A TrainingJob labelled `kueue.x-k8s.io/queue-name: Q` is one Kueue Workload for its whole
gang, which the operator owns as Kueue's own job integrations own theirs (Kueue docs, "Run
a custom workload" / "Integrate a custom Job with Kueue"; `pkg/controller/jobframework/
reconciler.go`, `ReconcileGenericJob`). Kueue decides quota, admission, preemption; the
operator does the job side:
- create the Workload (one podSet, `count` = replicas) while the gang is held back;
- hold the gang (an effective `spec.suspend`) until the Workload is Admitted, then launch
  with the admitted count and the admitted flavors' node labels and tolerations merged into
  the pods (`pkg/podset/podset.go`, from each ResourceFlavor's `spec.nodeLabels` and
  `spec.tolerations`);
- on eviction (`Evicted=True`, e.g. `Preempted`): stop the gang after a save, exactly as a
  suspension does; once no pod is active, release the quota in one status write
  (QuotaReserved=False reason Pending, admission cleared, Admitted=False, Requeued=True),
  which is what Kueue waits for (`pkg/workload/workload.go`, the requeue after eviction);
- on a resize (`spec.replicas` no longer the Workload's count): a Workload without quota
  takes the new count; a shrink of an admitted gang stays inside its admission (the gang
  stops after a save and relaunches smaller, as without Kueue) and, once the smaller gang
  runs, hands the replicas it no longer needs back as `status.reclaimablePods` (Kueue's
  ReclaimablePods, beta and on since 0.15: the ClusterQueue's usage drops to what runs, and
  the queue's waiting workloads are looked at again; `pkg/workload/workload.go`,
  `totalRequestsFromAdmission`); any other change to an admitted count stops the gang after
  a save, as an eviction does, then the Workload is deleted and made again at the new
  count, which Kueue queues and admits as any other (jobframework's `ensureOneWorkload`);
- a grow of a running gang first asks Kueue for the extra replicas alone, in a second
  Workload (role `grow`, held to the admitted flavor's node labels) while the gang trains on
  at the admitted count; only once Kueue reserves that quota does the gang stop after a save,
  both Workloads go and the one at the new count is made (docs/kueue.md, "Growing");
- `PodsReady` (what Kueue's `waitForPodsReady` times out on, on by default since v0.19):
  True once every rank of the admitted gang runs, False with Kueue's reasons while the gang
  starts (`WaitForStart`) or relaunches after it ran (`WaitForRecovery`), as jobframework's
  `generatePodsReadyCondition` writes it for Kueue's own jobs (`pods_ready`);
- `spec.suspend` deactivates the Workload (`spec.active: false`, marked as the job's own):
  Kueue evicts it (reason `Deactivated`) and the release above hands its quota back; a
  resume reactivates it (Kueue requeues it). Only the job's own deactivation is undone;
  Kueue's or an admin's is left and reported;
- the labels follow: a new queue label moves a Workload that holds no quota (`queueName`)
  and remakes one that does after the gang saved (Kueue refuses the change then); a new
  priority label rewrites `priorityClassRef`/`priority` where Kueue allows it; a removed
  queue label drops the job's Workloads (`stray_workload_actions`);
- a change of what a rank asks for (requests, limits, accelerators, node selector,
  tolerations: `podset_hash`, stamped on the Workload) is a resize through Kueue: the
  Workload is made again (or, holding no quota, updated) and the gang relaunches only once
  that is admitted, never outside the admission (`QueueGate.mismatch`);
- admission outputs: the admission checks' `podSetUpdates` go on the pods after the
  flavors'; a `topologyAssignment` (Topology Aware Scheduling, asked for with
  `spec.topology` as the podSet's `topologyRequest`) makes the pods wait behind Kueue's
  topology gate for its ungater to place them (`topology_pod`); an admitted flavor the
  operator cannot read, an assignment the pods cannot carry, or updates that contradict the
  pods hold the launch with a reason naming it (`QueueGate.hold`);
- quota is freed (release, delete, finish) only once no pod of the gang is active,
  terminating pods included (docs/kueue.md, "Quota freed last");
- on the end of the job: `Finished=True`, which frees the quota.

Nothing here touches a job without the label, but for the admin's rule that jobs carry one
(`queue_name_rule.py`): such a job is held as one Kueue has not admitted, and writes no
Workload. The handlers read the Workload and the flavors
from indexes and apply what `workload_actions` lists (`kube.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from tardigrade_operator import naming
from tardigrade_operator.api.types import (
    Toleration,
    TrainingJobSpec,
    TrainingJobStatus,
)
from tardigrade_operator.decision import queue_name_rule
from tardigrade_operator.rendering.placement import placement_for
from tardigrade_operator.rendering.slice_placement import NODE_POOL_LABEL
from tardigrade_operator.rendering.tpu_layout import hosts_per_slice

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
JOB_LABEL = "tardigrade.dev/job"
# What a rank asks of a node (podSet requests, limits, selector, tolerations) when the
# Workload was made: an admitted job whose pods would now ask for something else is resized
# through Kueue, never run outside the admission (`QueueGate.mismatch`).
PODSET_HASH_ANNOTATION = "tardigrade.dev/podset-hash"
# On a Workload the operator deactivated for the job's spec.suspend: only such a deactivation
# is undone on resume, never one by Kueue (requeuing limit, maximum execution time, a
# rejected admission check) or by an admin stopping the workload by hand.
SUSPENDED_ANNOTATION = "tardigrade.dev/suspended"
# Which of a job's Workloads: the gang's own, or the request for the extra replicas of a grow.
ROLE_LABEL = "tardigrade.dev/workload-role"
GROW_ROLE = "grow"
GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
WORKLOADS = "workloads"
FLAVORS = "resourceflavors"
PRIORITY_CLASSES = "workloadpriorityclasses"
PODSET = "trainers"
PODSET_LABEL = "kueue.x-k8s.io/podset"
# Topology Aware Scheduling (Kueue's `apis/kueue/v1beta2/topology_types.go`): a pod admitted
# with a topologyAssignment is created behind this scheduling gate; Kueue's TopologyUngater
# (`pkg/controller/tas/topology_ungater.go`) finds the Workload's pods by the workload
# annotation (an index on it) and the podset label, only if one of the TAS annotations marks
# them (`utiltas.IsTAS`; also what keeps them out of the non-TAS usage Kueue subtracts from the
# nodes), then removes the gate and adds the node labels of the pod's assigned domain.
TOPOLOGY_GATE = "kueue.x-k8s.io/topology"
WORKLOAD_ANNOTATION = "kueue.x-k8s.io/workload"
REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"
PREFERRED_TOPOLOGY = "kueue.x-k8s.io/podset-preferred-topology"
UNCONSTRAINED_TOPOLOGY = "kueue.x-k8s.io/podset-unconstrained-topology"
PODS_READY = "PodsReady"
# PodsReady's reasons (Kueue's `apis/kueue/v1beta2/workload_types.go`): False while the gang
# starts, or relaunches after it ran; True once it runs, first or again.
WAIT_FOR_START = "WaitForStart"
# Kueue's eviction reason for a Workload whose spec.active is false.
DEACTIVATED = "Deactivated"
WAIT_FOR_RECOVERY = "WaitForRecovery"
STARTED = "Started"
RECOVERED = "Recovered"
# The Workload's name, as Kueue's jobframework names one for an owner
# (`GetWorkloadNameForOwnerWithGVK`: "<kind>-<name>" truncated, "-", 5 hex of a sha1).
MAX_PREFIX = 253 - 6


def workload_name(job_name: str, job_uid: str) -> str:
    digest = hashlib.sha1(f"TrainingJob\ntardigrade.dev\n{job_name}\n{job_uid}".encode())
    return f"{('trainingjob-' + job_name)[:MAX_PREFIX]}-{digest.hexdigest()[:5]}"


def grow_workload_name(job_name: str, job_uid: str) -> str:
    """The Workload asking for a grow's extra replicas: one per job at a time."""
    digest = hashlib.sha1(f"TrainingJob\ntardigrade.dev\n{job_name}\n{job_uid}\ngrow".encode())
    return f"{('trainingjob-' + job_name)[:MAX_PREFIX - 5]}-grow-{digest.hexdigest()[:5]}"


def queue_name(labels: Mapping[str, str]) -> str | None:
    return labels.get(QUEUE_LABEL) or None


@dataclasses.dataclass(frozen=True)
class WorkloadCondition:
    status: str
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class PodSetUpdate:
    """What an admission check asks of the pods (`status.admissionChecks[].podSetUpdates`
    for our podSet; Kueue's `podset.FromUpdate`), merged over every check."""

    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    # "field key: a vs b" where two checks disagree (Kueue's `Merge` refuses those too).
    conflicts: tuple[str, ...] = ()


def _merge_updates(updates: Sequence[Mapping[str, Any]]) -> PodSetUpdate:
    merged: dict[str, dict[str, str]] = {"labels": {}, "annotations": {}, "nodeSelector": {}}
    tolerations: list[Mapping[str, Any]] = []
    conflicts: list[str] = []
    for update in updates:
        for field, into in merged.items():
            for key, value in (update.get(field) or {}).items():
                if key in into and into[key] != str(value):
                    conflicts.append(f"{field} {key}: {into[key]!r} vs {str(value)!r}")
                into[key] = str(value)
        tolerations += [t for t in update.get("tolerations") or [] if t not in tolerations]
    return PodSetUpdate(merged["labels"], merged["annotations"], merged["nodeSelector"],
                        tolerations, tuple(conflicts))


@dataclasses.dataclass(frozen=True)
class TopologyAssignment:
    """The admission's topologyAssignment for our podSet: node label keys from the highest
    level to the lowest, and each assigned domain's values at those levels with its pods, in
    Kueue's order (rank r goes to the r-th pod of this list: the ungater's `rankToDomainID`)."""

    levels: tuple[str, ...]
    domains: tuple[tuple[tuple[str, ...], int], ...]

    @property
    def pods(self) -> int:
        return sum(count for _, count in self.domains)

    def node_labels(self, rank: int) -> dict[str, str] | None:
        """The node labels Kueue's ungater gives the pod of `rank`; None beyond the assignment."""
        for values, count in self.domains:
            if rank < count:
                return dict(zip(self.levels, values, strict=True))
            rank -= count
        return None


def _level_values(level: Mapping[str, Any], count: int) -> list[str]:
    if level.get("universal") is not None:
        return [str(level["universal"])] * count
    individual = level.get("individual") or {}
    prefix, suffix = individual.get("prefix") or "", individual.get("suffix") or ""
    return [f"{prefix}{root}{suffix}" for root in individual.get("roots") or []]


def parse_topology_assignment(body: Mapping[str, Any]) -> TopologyAssignment:
    """Kueue v1beta2's compact form (`slices` of domains; `pkg/util/tas`, `InternalSeqFrom`)."""
    levels = tuple(str(level) for level in body.get("levels") or [])
    domains: list[tuple[tuple[str, ...], int]] = []
    for piece in body.get("slices") or []:
        count = int(piece.get("domainCount") or 0)
        values = [_level_values(level, count) for level in piece.get("valuesPerLevel") or []]
        counts = piece.get("podCounts") or {}
        pods = ([int(counts["universal"])] * count if counts.get("universal") is not None
                else [int(c) for c in counts.get("individual") or []])
        for index in range(min(count, len(pods))):
            domains.append((tuple(v[index] if index < len(v) else "" for v in values),
                            pods[index]))
    return TopologyAssignment(levels, tuple(domains))


@dataclasses.dataclass(frozen=True)
class WorkloadView:
    """What the operator reads of its Workload."""

    name: str
    owner_uid: str | None
    resource_version: str
    count: int
    conditions: Mapping[str, WorkloadCondition]
    # Admitted podSet: (count, {resource: flavor}); None when no admission is recorded.
    admitted_count: int | None = None
    # The podSet's minCount (partial admission), if any.
    min_count: int | None = None
    admitted_flavors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cluster_queue: str | None = None
    deleting: bool = False
    role: str = "main"
    # The WorkloadPriorityClass and value it was made with, if any.
    priority: tuple[str, int] | None = None
    # status.reclaimablePods for the podSet: replicas handed back after a shrink.
    reclaimable: int = 0
    # spec.queueName: the LocalQueue it waits in ("" where unread).
    queue_name: str = ""
    # spec.active: False once deactivated; Kueue then evicts it.
    active: bool = True
    # Deactivated by the operator for the job's spec.suspend (SUSPENDED_ANNOTATION).
    suspended_by_job: bool = False
    # PODSET_HASH_ANNOTATION; None on a Workload made before it existed (never remade for it).
    podset_hash: str | None = None
    # The admission checks' podSetUpdates for our podSet.
    updates: PodSetUpdate = PodSetUpdate()
    # Admission checks not Ready yet: (name, state, message), e.g. a ProvisioningRequest
    # check Pending until the cloud provisions the nodes.
    pending_checks: tuple[tuple[str, str, str], ...] = ()
    # The admission's topologyAssignment (Topology Aware Scheduling) for our podSet, if any.
    topology: TopologyAssignment | None = None
    # The podSet's topologyRequest as the Workload carries it (what the pods' TAS annotation
    # repeats), if any.
    topology_request: Mapping[str, Any] | None = None

    @property
    def topology_assigned(self) -> bool:
        return self.topology is not None

    def true(self, kind: str) -> bool:
        condition = self.conditions.get(kind)
        return condition is not None and condition.status == "True"

    @property
    def admitted(self) -> bool:
        return (self.true("QuotaReserved") and self.true("Admitted") and not self.true("Evicted")
                and self.admitted_count is not None)


def _checks_message(workload: WorkloadView) -> str:
    """A Workload holding quota while admission checks are not Ready, in Kueue's words."""
    return "quota reserved, " + "; ".join(
        f"admission check {name} {state}" + (f": {text}" if text else "")
        for name, state, text in workload.pending_checks)


def parse_workload(body: Mapping[str, Any]) -> WorkloadView:
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    owners = [o for o in meta.get("ownerReferences") or [] if o.get("controller")]
    conditions = {c["type"]: WorkloadCondition(str(c.get("status")), str(c.get("reason") or ""),
                                               str(c.get("message") or ""))
                  for c in status.get("conditions") or [] if c.get("type")}
    podsets = spec.get("podSets") or [{}]
    admission = status.get("admission") or None
    count, flavors, queue, topology = None, {}, None, None
    if admission:
        queue = admission.get("clusterQueue")
        assignment = next((a for a in admission.get("podSetAssignments") or []
                           if a.get("name") == PODSET), None)
        if assignment is not None:
            count = int(assignment.get("count") or podsets[0].get("count") or 0)
            flavors = dict(assignment.get("flavors") or {})
            if assignment.get("topologyAssignment"):
                topology = parse_topology_assignment(assignment["topologyAssignment"])
    updates = [u for check in status.get("admissionChecks") or []
               for u in check.get("podSetUpdates") or [] if u.get("name") == PODSET]
    pending_checks = tuple((str(c.get("name")), str(c.get("state") or "Pending"),
                            str(c.get("message") or ""))
                           for c in status.get("admissionChecks") or []
                           if c.get("state") != "Ready")
    reclaimable = sum(int(r.get("count") or 0) for r in status.get("reclaimablePods") or []
                      if r.get("name") == PODSET)
    priority_class = (spec.get("priorityClassRef") or {}).get("name")
    priority = (str(priority_class), int(spec.get("priority") or 0)) if priority_class else None
    return WorkloadView(
        name=str(meta.get("name")), owner_uid=owners[0].get("uid") if owners else None,
        resource_version=str(meta.get("resourceVersion") or ""),
        count=int(podsets[0].get("count") or 0), conditions=conditions,
        min_count=int(podsets[0]["minCount"]) if podsets[0].get("minCount") else None,
        admitted_count=count, admitted_flavors=flavors, cluster_queue=queue,
        deleting=bool(meta.get("deletionTimestamp")),
        role=str((meta.get("labels") or {}).get(ROLE_LABEL) or "main"), priority=priority,
        reclaimable=reclaimable, queue_name=str(spec.get("queueName") or ""),
        active=spec.get("active") is not False,
        suspended_by_job=(meta.get("annotations") or {}).get(SUSPENDED_ANNOTATION) == "true",
        podset_hash=(meta.get("annotations") or {}).get(PODSET_HASH_ANNOTATION),
        updates=_merge_updates(updates), pending_checks=pending_checks, topology=topology,
        topology_request=podsets[0].get("topologyRequest") or None)


@dataclasses.dataclass(frozen=True)
class Flavor:
    """A ResourceFlavor's node labels and tolerations."""

    node_labels: Mapping[str, str]
    tolerations: Sequence[Mapping[str, Any]]


def parse_flavor(body: Mapping[str, Any]) -> Flavor:
    spec = body.get("spec") or {}
    return Flavor(dict(spec.get("nodeLabels") or {}), list(spec.get("tolerations") or []))


# The oldest Kueue Tardigrade is tested against (the Workload API it uses, v1beta2, came in
# v0.15; v1beta1 went in v0.17).
MINIMUM_KUEUE = "v0.17"


@dataclasses.dataclass(frozen=True)
class KueueApi:
    """What discovery says of Kueue: whether Workloads are served at VERSION, and, where they
    are not, the versions of Kueue's group that are (a Kueue too old for us serves some)."""

    workloads: bool = True
    other_versions: tuple[str, ...] = ()

    @property
    def too_old(self) -> bool:
        return not self.workloads and bool(self.other_versions)


@dataclasses.dataclass(frozen=True)
class QueueGate:
    """How Kueue holds a labelled job: the input `decide` reads."""

    queue: str
    workload: WorkloadView | None
    # The admitted flavors' node labels and tolerations, merged.
    flavor_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    flavor_tolerations: Sequence[Mapping[str, Any]] = ()
    # The job's spec.replicas; None where the spec cannot be read.
    replicas: int | None = None
    # The Workload asking for a grow's extra replicas, if one exists.
    grow: WorkloadView | None = None
    # What is served of Kueue. Without its Workload API the label cannot be honoured: the
    # job is held, not run outside the quota its owner asked to be held to.
    kueue: KueueApi = KueueApi()
    # Set where the job has no queue label and the admin requires one in its namespace
    # (queue_name_rule.py): the namespace, named in the fix the job is told.
    queue_name_required_in: str | None = None
    # The job's spec.suspend: its Workload is deactivated (spec.active false) meanwhile.
    suspended: bool = False
    # podset_hash of the job as it is now; None where the spec cannot be read.
    podset_hash: str | None = None
    # Admitted flavors the operator's ResourceFlavor index does not hold.
    missing_flavors: tuple[str, ...] = ()
    # Where the admission checks' podSetUpdates contradict the flavors or the job's own pod
    # template (Kueue's `podset.Merge` refuses those too).
    update_conflicts: tuple[str, ...] = ()
    # The job's kueue.x-k8s.io/priority-class label, if any.
    priority_class: str | None = None
    # Some pod of the gang is active: what only a launch needs (a readable flavor, a
    # placement we honour) never stops a gang that already runs.
    gang_active: bool = False
    # Where the topologyAssignment's node labels contradict what the pods already select
    # (their own, the accelerator's, the flavors' or the admission checks' node selector).
    topology_conflicts: tuple[str, ...] = ()

    @property
    def installed(self) -> bool:
        return self.kueue.workloads

    @property
    def held(self) -> int | None:
        """The replicas the Workload holds quota for: the admitted count (fewer than asked
        for after a partial admission), else the count asked for; less what a shrink handed
        back (Kueue counts min(admitted, count - reclaimable))."""
        workload = self.workload
        if workload is None:
            return None
        held = workload.admitted_count if workload.admitted_count is not None else workload.count
        return min(held, workload.count - workload.reclaimable)

    @property
    def mismatch(self) -> str | None:
        """What of the Workload no longer matches the job, its count aside: `queue` (the
        queue label names another LocalQueue) or `podset` (a rank would ask for other
        resources, accelerators or nodes than the Workload was made with). Held quota is
        never stretched to cover it: the Workload is made again (`resizing`)."""
        workload = self.workload
        if workload is None:
            return None
        if workload.queue_name and workload.queue_name != self.queue:
            return "queue"
        if (workload.podset_hash is not None and self.podset_hash is not None
                and workload.podset_hash != self.podset_hash):
            return "podset"
        return None

    @property
    def hold(self) -> tuple[str, str] | None:
        """Why a gang Kueue admitted is not launched as admitted: (reason, message); None
        when nothing holds it. Never for a gang already running."""
        workload = self.workload
        if workload is None or not workload.admitted or self.gang_active:
            return None
        if self.missing_flavors:
            names = ", ".join(self.missing_flavors)
            return ("FlavorNotFound", (
                f"Kueue admitted the Workload on ResourceFlavor {names}, which the operator "
                "cannot read (deleted, or not served to it): held, not launched without the "
                "flavor's node labels and tolerations, until the flavor can be read"))
        topology = workload.topology
        if topology is not None and self.topology_conflicts:
            clash = "; ".join(self.topology_conflicts)
            return ("TopologyNotSupported", (
                f"Kueue's topologyAssignment for podSet {PODSET} contradicts the node selector "
                f"the pods already carry ({clash}): held, not placed against either; drop the "
                "key from the TrainingJob's podTemplate.nodeSelector, or from the flavor's "
                "nodeLabels or the admission check"))
        runs = self.runs
        if topology is not None and runs is not None and topology.pods < runs:
            return ("TopologyNotSupported", (
                f"Kueue's topologyAssignment for podSet {PODSET} places {topology.pods} pods "
                f"and the gang runs {runs}: held, as the ranks beyond it would stay gated"))
        if workload.updates.conflicts or self.update_conflicts:
            clash = "; ".join([*workload.updates.conflicts, *self.update_conflicts])
            return ("PodSetUpdateConflict", (
                f"the admission checks' podSetUpdates contradict the pods ({clash}): held, "
                "not launched; fix the TrainingJob's podTemplate or the admission check"))
        return None

    @property
    def growing(self) -> bool:
        """The job asks for more replicas than its admitted, running Workload holds (a grow,
        or the rest of a partial admission): the extra ones are asked for on their own while
        the gang trains on."""
        workload, held = self.workload, self.held
        return (workload is not None and held is not None and self.replicas is not None
                and self.replicas > held and workload.admitted and self.mismatch is None
                and self.hold is None and not self.suspended)

    @property
    def grow_extra(self) -> int | None:
        """How many replicas the grow Workload should ask for; None when none is wanted."""
        if not self.growing:
            return None
        assert self.held is not None and self.replicas is not None
        return self.replicas - self.held

    @property
    def grow_reserved(self) -> bool:
        """Kueue admitted exactly the extra replicas the job still asks for: quota reserved
        and every admission check passed (a ProvisioningRequest check: the extra nodes are
        provisioned), so the gang trains on at its size until the new capacity is there.
        Admitted, not only QuotaReserved: Kueue lists a ClusterQueue's checks on the
        Workload only after it reserved quota, and sets Admitted with QuotaReserved where
        the ClusterQueue has none (its scheduler's `admit`)."""
        grow = self.grow
        return (self.growing and grow is not None and not grow.deleting
                and grow.count == self.grow_extra and grow.true("QuotaReserved")
                and grow.true("Admitted") and not grow.pending_checks
                and not grow.true("Evicted"))

    @property
    def resizing(self) -> bool:
        """The Workload must be made again at another count, and the gang stop for it: a
        grow whose extra quota is reserved, or a Workload that holds quota without running
        the gang anyway. A shrink of an admitted gang runs inside its admission (`runs`) and
        hands the rest back; a job scaled to exactly what a partial admission runs goes on."""
        workload, held = self.workload, self.held
        if workload is None or held is None or self.replicas is None:
            return False
        if not workload.true("QuotaReserved"):
            return False
        if self.mismatch is not None:
            return True
        if not workload.admitted:
            return workload.count != self.replicas
        return self.grow_reserved

    @property
    def runs(self) -> int | None:
        """The replicas an admitted gang runs with: what the job asks for, up to what the
        Workload holds (the rest of a grow waits in its own Workload)."""
        if self.held is None:
            return None
        return self.held if self.replicas is None else min(self.replicas, self.held)

    @property
    def reclaim(self) -> int | None:
        """status.reclaimablePods that hands back what a shrunk gang no longer uses; None
        when nothing more is to be handed back."""
        workload, held = self.workload, self.held
        if (workload is None or held is None or self.replicas is None
                or self.replicas >= held or not workload.admitted or self.resizing):
            return None
        # Kueue counts min(admitted, count - reclaimable): this leaves it at what runs.
        wanted = workload.count - self.replicas
        return wanted if wanted > workload.reclaimable else None

    @property
    def admitted(self) -> bool:
        # A Workload being deleted (a resize's, held by Kueue's finalizer until its quota is
        # released) still reads Admitted: no gang starts under it.
        workload = self.workload
        return (workload is not None and workload.admitted and not workload.deleting
                and not self.resizing and self.hold is None)

    @property
    def evicted(self) -> bool:
        """Kueue evicted the Workload, for its own reasons: not the deactivation that a
        suspension of the job asked for, nor a deactivation since undone (Kueue clears
        Evicted only at the next admission)."""
        workload = self.workload
        if workload is None or not workload.true("Evicted"):
            return False
        deactivated = workload.conditions["Evicted"].reason.startswith(DEACTIVATED)
        return not (deactivated and (workload.active or workload.suspended_by_job))

    def waiting_message(self) -> str:
        """Why the job waits, in Kueue's words where Kueue has said something."""
        workload = self.workload
        if self.queue_name_required_in is not None:
            return queue_name_rule.fix_message(self.queue_name_required_in)
        if self.kueue.too_old:
            served = ", ".join(f"{GROUP}/{v}" for v in self.kueue.other_versions)
            return (f"the label {QUEUE_LABEL}: {self.queue} asks for Kueue, and the Kueue "
                    f"installed is older than v0.15 (it serves {served}, no "
                    f"{WORKLOADS}.{GROUP}/{VERSION}): Tardigrade needs Kueue >= "
                    f"{MINIMUM_KUEUE}; upgrade Kueue, or remove the label to run without a "
                    "queue")
        if not self.installed:
            return (f"the label {QUEUE_LABEL}: {self.queue} asks for Kueue, which is not "
                    f"installed (the API server serves no {WORKLOADS}.{GROUP}/{VERSION}): "
                    "install Kueue, or remove the label to run without a queue")
        if workload is None:
            return f"creating the Workload for LocalQueue {self.queue}"
        if self.suspended:
            return (f"suspended (spec.suspend): the Workload is deactivated and holds no quota "
                    f"once the gang stopped; set spec.suspend to false to queue again in "
                    f"LocalQueue {self.queue}")
        if not workload.active and not workload.suspended_by_job:
            evicted = workload.conditions.get("Evicted")
            why = f" ({evicted.reason}: {evicted.message})" if evicted else ""
            return (f"the Workload {workload.name} is deactivated (spec.active false){why}, "
                    "not by this job's spec.suspend: Kueue admits it again only once it is "
                    "set active (kubectl patch workload), or delete and re-create the job")
        if not workload.active or (workload.true("Evicted") and not self.evicted
                                   and workload.true("QuotaReserved")):
            return (f"resumed: reactivating the Workload in LocalQueue {self.queue}")
        hold = self.hold
        if hold is not None:
            return hold[1]
        if self.resizing and self.mismatch == "queue":
            return (f"moved from LocalQueue {workload.queue_name} to {self.queue}: stopping "
                    f"the gang after a save, then queued in LocalQueue {self.queue}")
        if self.resizing and self.mismatch == "podset":
            return (f"the pods ask for other resources than Kueue admitted: stopping the gang "
                    f"after a save, then queued again in LocalQueue {self.queue} for what "
                    "they ask now")
        if self.evicted:
            evicted = workload.conditions["Evicted"]
            return (f"evicted by Kueue ({evicted.reason}: {evicted.message}); stopping the "
                    f"gang after a save, then requeued in LocalQueue {self.queue}")
        if self.resizing and self.grow_reserved:
            return (f"Kueue reserved quota for {self.grow_extra} more replicas: stopping the "
                    f"gang of {self.held} after a save, then relaunching it at "
                    f"{self.replicas}")
        if self.resizing:
            return (f"resized from {self.held} to {self.replicas} replicas: stopping the "
                    f"gang after a save, then requeued in LocalQueue {self.queue} at the new "
                    "size")
        reserved = workload.conditions.get("QuotaReserved")
        if workload.true("QuotaReserved") and workload.pending_checks:
            return f"waiting in LocalQueue {self.queue}: {_checks_message(workload)}"
        if reserved is not None and reserved.message:
            return f"waiting in LocalQueue {self.queue}: {reserved.message}"
        return f"waiting in LocalQueue {self.queue} for Kueue to admit the Workload"

    def grow_message(self) -> str:
        """Why a grow waits while the gang trains at its admitted count."""
        assert self.workload is not None
        reserved = self.grow.conditions.get("QuotaReserved") if self.grow else None
        why = (reserved.message if reserved is not None and reserved.message
               else "waiting for Kueue to reserve quota")
        if self.grow is not None and self.grow.true("QuotaReserved") and self.grow.pending_checks:
            why = _checks_message(self.grow)
        return (f"growing to {self.replicas} replicas: {self.grow_extra} more wait in LocalQueue "
                f"{self.queue} ({why}); the gang trains at {self.held} meanwhile")

    def reason(self) -> str:
        if self.queue_name_required_in is not None:
            return queue_name_rule.REASON
        if self.kueue.too_old:
            return "KueueTooOld"
        if not self.installed:
            return "KueueNotInstalled"
        workload = self.workload
        if workload is not None and not workload.active and not workload.suspended_by_job:
            return "Deactivated"
        if self.evicted:
            return "Evicted"
        hold = self.hold
        if hold is not None:
            return hold[0]
        if self.resizing:
            return "QueueChanged" if self.mismatch == "queue" else "Resizing"
        return "Queued"


def gate_for(queue: str, workload: WorkloadView | None, flavors: Mapping[str, Flavor],
             replicas: int | None = None, grow: WorkloadView | None = None,
             kueue: KueueApi = KueueApi(), *, spec: TrainingJobSpec | None = None,
             gang_active: bool = False, priority_class: str | None = None) -> QueueGate:
    """Kueue's hold on a job, from its Workloads and the flavors' index. `spec`: the job's
    spec as its owner wrote it (not the gated one), for what its pods ask for and whether it
    is suspended."""
    selector: dict[str, str] = {}
    tolerations: list[Mapping[str, Any]] = []
    missing: list[str] = []
    conflicts: list[str] = []
    if workload is not None:
        for name in sorted(set(workload.admitted_flavors.values())):
            flavor = flavors.get(name)
            if flavor is None:
                missing.append(name)
                continue
            selector.update(flavor.node_labels)
            tolerations += [t for t in flavor.tolerations if t not in tolerations]
        updates = workload.updates
        template = spec.pod_template if spec is not None else None
        mine = {"nodeSelector": {**(template.node_selector if template else {}), **selector},
                "labels": dict(template.labels) if template else {},
                "annotations": dict(template.annotations) if template else {}}
        asked = {"nodeSelector": updates.node_selector, "labels": updates.labels,
                 "annotations": updates.annotations}
        for field, values in asked.items():
            conflicts += [f"{field} {key}: {mine[field][key]!r} vs {value!r}"
                          for key, value in sorted(values.items())
                          if key in mine[field] and mine[field][key] != value]
    topology_conflicts: list[str] = []
    if workload is not None and workload.topology is not None:
        pinned = {**(placement_for(spec).node_selector if spec is not None else {}),
                  **selector, **workload.updates.node_selector}
        for index, level in enumerate(workload.topology.levels):
            assigned = sorted({values[index] for values, _ in workload.topology.domains})
            if level in pinned and any(value != pinned[level] for value in assigned):
                topology_conflicts.append(
                    f"{level}: {pinned[level]!r} vs {', '.join(map(repr, assigned))}")
    return QueueGate(queue, workload, selector, tolerations, replicas, grow, kueue,
                     suspended=spec is not None and spec.suspend,
                     podset_hash=podset_hash(spec) if spec is not None else None,
                     missing_flavors=tuple(missing), update_conflicts=tuple(conflicts),
                     gang_active=gang_active, priority_class=priority_class,
                     topology_conflicts=tuple(topology_conflicts))


def queue_name_hold(namespace: str) -> QueueGate:
    """The hold on a job the admin's rule requires a queue label of: never admitted (so
    never launched), no Workload; the label added, the next pass builds a gate from it."""
    return QueueGate("", None, queue_name_required_in=namespace)


def gated_spec(spec: TrainingJobSpec, gate: QueueGate | None) -> TrainingJobSpec:
    """The spec the gang is run from: held back (suspend) until admitted; once admitted, at
    the admitted count, with the flavors' node labels and tolerations added to the pods."""
    if gate is None:
        return spec
    if not gate.admitted:
        return spec.model_copy(update={"suspend": True})
    assert gate.runs is not None and gate.workload is not None
    template = spec.pod_template
    updates = gate.workload.updates
    tolerations = [*template.tolerations]
    for toleration in [*gate.flavor_tolerations, *updates.tolerations]:
        parsed = Toleration.model_validate(dict(toleration))
        if parsed not in tolerations:
            tolerations.append(parsed)
    # The admission checks' podSetUpdates after the flavors', as jobframework's startJob
    # merges them (`podset.FromAssignment`, then `FromUpdate` for each check).
    pod_template = template.model_copy(update={
        "node_selector": {**template.node_selector, **gate.flavor_selector,
                          **updates.node_selector},
        "tolerations": tolerations,
        "annotations": {**template.annotations, **updates.annotations},
        "labels": {**template.labels, **updates.labels, PODSET_LABEL: PODSET}})
    return spec.model_copy(update={"pod_template": pod_template, "replicas": gate.runs})


def topology_pod(pod: dict[str, Any], workload: WorkloadView) -> dict[str, Any]:
    """A pod of a gang admitted with a topologyAssignment, as Kueue's TAS expects a pod it does
    not own (Kueue's own jobs' pods get the same: `podset.FromAssignment` adds the gate, and
    the unconstrained annotation where no level was asked; jobframework's reconciler the
    workload annotation): behind the scheduling gate until Kueue's ungater sets the node
    labels of the rank's domain (ranks ordered by the rank label, the podSet's
    `podIndexLabel`)."""
    request = workload.topology_request or {}
    if request.get("required"):
        marker = {REQUIRED_TOPOLOGY: str(request["required"])}
    elif request.get("preferred"):
        marker = {PREFERRED_TOPOLOGY: str(request["preferred"])}
    else:
        # No level asked for (Kueue's implicit TAS, or only each TPU slice kept together).
        marker = {UNCONSTRAINED_TOPOLOGY: "true"}
    meta = pod["metadata"]
    spec = pod["spec"]
    gates = [g for g in spec.get("schedulingGates") or [] if g.get("name") != TOPOLOGY_GATE]
    return {**pod,
            "metadata": {**meta, "annotations": {**(meta.get("annotations") or {}), **marker,
                                                 WORKLOAD_ANNOTATION: workload.name}},
            "spec": {**spec, "schedulingGates": [*gates, {"name": TOPOLOGY_GATE}]}}


# ----------------------------------------------------------------------- Workload writes ---


@dataclasses.dataclass(frozen=True)
class JobIdentity:
    name: str
    namespace: str
    uid: str


def pod_set_template(spec: TrainingJobSpec, held_to: Mapping[str, str] | None = None
                     ) -> dict[str, Any]:
    """What one rank asks of a node: Kueue counts quota from the requests (extended
    resources from the limits, as for pods) and matches flavors against the selectors.
    `held_to`: node labels added to the selector (a grow's extra replicas must land on the
    flavor the gang already runs on)."""
    placement = placement_for(spec)
    requests = {**spec.resources.requests, **placement.accelerator_limits}
    limits = {**spec.resources.limits, **placement.accelerator_limits}
    container: dict[str, Any] = {"name": "trainer", "image": spec.image, "resources": {
        k: v for k, v in (("requests", requests), ("limits", limits)) if v}}
    pod: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    selector = {**placement.node_selector, **(held_to or {})}
    if selector:
        pod["nodeSelector"] = selector
    if placement.tolerations:
        pod["tolerations"] = list(placement.tolerations)
    if spec.pod_template.priority_class_name:
        pod["priorityClassName"] = spec.pod_template.priority_class_name
    return {"spec": pod}


def topology_request(spec: TrainingJobSpec) -> dict[str, Any] | None:
    """The podSet's `topologyRequest` (Kueue v0.19's fields, as jobframework builds it from the
    TAS annotations, `NewPodSetTopologyRequest`) for a job that set `spec.topology`; None
    otherwise (Kueue still applies TAS where the flavor names a Topology, and the pods then
    follow its assignment all the same). The rank label orders the ranks over the assigned
    domains. A multi-host TPU slice is one node pool on GKE, so each slice of hosts must be one
    domain of `cloud.google.com/gke-nodepool` (the Topology needs that level)."""
    topology = spec.topology
    if topology is None:
        return None
    request: dict[str, Any] = {"podIndexLabel": naming.LABEL_RANK}
    if topology.required:
        request["required"] = topology.required
    elif topology.preferred:
        request["preferred"] = topology.preferred
    else:
        request["unconstrained"] = True
    per_slice = hosts_per_slice(spec.accelerator)
    if per_slice is not None and per_slice > 1:
        request["podSetSliceRequiredTopology"] = NODE_POOL_LABEL
        request["podSetSliceSize"] = per_slice
    return request


def podset_hash(spec: TrainingJobSpec) -> str:
    """A digest of what a rank asks of a node and of the quota (requests, limits, node
    selector, tolerations; not the image, which no quota counts): a change to it on an
    admitted job is a resize through Kueue."""
    pod = pod_set_template(spec)["spec"]
    asked = {"resources": pod["containers"][0].get("resources") or {},
             "nodeSelector": pod.get("nodeSelector") or {},
             "tolerations": pod.get("tolerations") or []}
    if spec.topology is not None:
        # Only where asked: the hash of every job without it stays what it was.
        asked["topologyRequest"] = topology_request(spec)
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()[:16]


def build_workload(job: JobIdentity, spec: TrainingJobSpec, queue: str, replicas: int,
                   priority: tuple[str, int] | None) -> dict[str, Any]:
    """The Workload of a job (jobframework's `ConstructWorkload`, for our kind): owned by the
    job (controller), labelled with its uid, one podSet for the gang."""
    return _workload(job, workload_name(job.name, job.uid), "main", queue,
                     replicas, pod_set_template(spec), priority, min_count(spec, replicas),
                     podset_hash(spec), active=not spec.suspend,
                     topology=topology_request(spec))


def min_count(spec: TrainingJobSpec, replicas: int) -> int | None:
    """The podSet's `minCount` (Kueue's PartialAdmission: Kueue admits as many as the quota
    holds, down to it): `spec.minReplicas`. Not for multi-host TPU slices, whose hosts come in
    whole slices, which Kueue's search for a count that fits does not keep to."""
    if spec.min_replicas is None or spec.min_replicas >= replicas:
        return None
    per_slice = hosts_per_slice(spec.accelerator)
    return spec.min_replicas if per_slice in (None, 1) else None


def build_grow_workload(job: JobIdentity, spec: TrainingJobSpec, gate: QueueGate
                        ) -> dict[str, Any]:
    """The request for a grow's extra replicas, at the gang's priority, held to the node
    labels of the flavor the gang was admitted on."""
    assert gate.workload is not None and gate.grow_extra is not None
    return _workload(job, grow_workload_name(job.name, job.uid), GROW_ROLE, gate.queue,
                     gate.grow_extra, pod_set_template(spec, gate.flavor_selector),
                     gate.workload.priority, None, podset_hash(spec),
                     topology=topology_request(spec))


def _workload(job: JobIdentity, name: str, role: str, queue: str, count: int,
              template: dict[str, Any], priority: tuple[str, int] | None,
              minimum: int | None, asked: str, active: bool = True,
              topology: dict[str, Any] | None = None) -> dict[str, Any]:
    podset: dict[str, Any] = {"name": PODSET, "count": count, "template": template}
    if topology is not None:
        podset["topologyRequest"] = topology
    workload: dict[str, Any] = {
        "apiVersion": API_VERSION, "kind": "Workload",
        "metadata": {
            "name": name, "namespace": job.namespace,
            "labels": {JOB_UID_LABEL: job.uid, JOB_LABEL: job.name, ROLE_LABEL: role},
            "annotations": {PODSET_HASH_ANNOTATION: asked},
            "ownerReferences": [{
                "apiVersion": "tardigrade.dev/v1alpha1", "kind": "TrainingJob",
                "name": job.name, "uid": job.uid, "controller": True,
                "blockOwnerDeletion": True}],
        },
        "spec": {"queueName": queue, "podSets": [podset]},
    }
    if minimum is not None:
        workload["spec"]["podSets"][0]["minCount"] = minimum
    if not active:
        workload["spec"]["active"] = False
    if priority is not None:
        name, value = priority
        workload["spec"]["priorityClassRef"] = {"group": GROUP, "kind": "WorkloadPriorityClass",
                                                "name": name}
        workload["spec"]["priority"] = value
    if not active:
        workload["metadata"]["annotations"][SUSPENDED_ANNOTATION] = "true"
    return workload


@dataclasses.dataclass(frozen=True)
class CreateWorkload:
    body: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ResizeWorkload:
    """A new count for a Workload that holds no quota (Kueue refuses podSet changes while
    QuotaReserved is true)."""

    name: str
    resource_version: str
    count: int
    min_count: int | None = None
    # Replicas a shrink handed back, dropped first: Kueue wants them <= the podSet's count.
    clear_reclaimable: bool = False
    # A new podSet template and its PODSET_HASH_ANNOTATION, where what a rank asks changed.
    template: dict[str, Any] | None = None
    podset_hash: str | None = None
    # With a new template: the podSet's topologyRequest (None: none).
    topology: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class PatchWorkloadSpec:
    """Fields of the Workload's spec to set (None: remove): `active` (the job suspended or
    resumed), `queueName` (its queue label moved while no quota is held), `priorityClassRef`
    and `priority` (its priority label changed), as jobframework keeps them in step with the
    job (`QueueNameChange`, `UpdateWorkloadPriority`, `JobWithCustomWorkloadActivation`)."""

    name: str
    resource_version: str
    changes: Mapping[str, Any]
    # metadata.annotations to set (None: remove).
    annotations: Mapping[str, str | None] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ReclaimPods:
    """Hand back the quota of replicas a shrunk gang no longer runs, once it runs smaller
    (`status.reclaimablePods`; Kueue refuses a decrease while quota is reserved)."""

    name: str
    resource_version: str
    count: int


@dataclasses.dataclass(frozen=True)
class ReleaseQuota:
    """The job side's answer to an eviction, once no pod of the gang is active."""

    name: str
    resource_version: str
    conditions: list[dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class DeleteWorkload:
    """A Workload admitted at a count the job no longer asks for, once the gang is stopped:
    deleting it frees its quota, and the next pass makes it again at the new count."""

    name: str
    resource_version: str


@dataclasses.dataclass(frozen=True)
class FinishWorkload:
    name: str
    resource_version: str
    conditions: list[dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class SetPodsReady:
    """The Workload's PodsReady condition moved (`pods_ready`): the conditions to store."""

    name: str
    resource_version: str
    conditions: list[dict[str, Any]]


WorkloadAction = (CreateWorkload | ResizeWorkload | ReleaseQuota | DeleteWorkload
                  | FinishWorkload | ReclaimPods | SetPodsReady | PatchWorkloadSpec)


def pods_ready(workload: WorkloadView, gang_running: bool) -> WorkloadCondition:
    """The PodsReady condition Kueue's job framework would write for this gang
    (`pkg/controller/jobframework/reconciler.go`, `generatePodsReadyCondition`).

    With `waitForPodsReady` (on by default since Kueue v0.19) Kueue evicts an admitted
    Workload whose PodsReady is not True within `timeout` of its admission (reason
    `WaitForStart`, or no condition at all), or within `recoveryTimeout` of turning False
    after it was True (`WaitForRecovery`): a gang that cannot start is evicted and requeued,
    one that trains for days is not. `gang_running`: every rank of the current attempt runs
    (the job's phase `Running`); the trainers have no readiness probe, so a started
    container is a ready rank."""
    current = workload.conditions.get(PODS_READY)
    if not workload.true("Admitted"):
        return WorkloadCondition("False", WAIT_FOR_START, "Not all pods are ready or succeeded")
    if gang_running:
        again = current is not None and current.reason in (WAIT_FOR_RECOVERY, RECOVERED)
        return WorkloadCondition("True", RECOVERED if again else STARTED,
                                 "All pods reached readiness and the workload is running")
    if current is not None and (current.status == "True" or current.reason == WAIT_FOR_RECOVERY):
        return WorkloadCondition("False", WAIT_FOR_RECOVERY,
                                 "At least one pod has failed, waiting for recovery")
    return WorkloadCondition("False", WAIT_FOR_START, "Not all pods are ready or succeeded")


def _pods_ready_changed(workload: WorkloadView, wanted: WorkloadCondition) -> bool:
    """Written only when its status or reason moves (jobframework's
    `HasConditionWithTypeAndReason`): a pass that changes nothing writes nothing."""
    current = workload.conditions.get(PODS_READY)
    return current is None or (current.status, current.reason) != (wanted.status, wanted.reason)


def _condition(kind: str, status: str, reason: str, message: str, now: datetime
               ) -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ")}


def workload_actions(job: JobIdentity, spec: TrainingJobSpec | None,
                     status: TrainingJobStatus, gate: QueueGate, gang_active: bool,
                     priority: tuple[str, int] | None, now: datetime,
                     current: Sequence[Mapping[str, Any]] = ()) -> list[WorkloadAction]:
    """What to write to the Workloads after this pass's plan: `status` is the job's status
    as the plan leaves it, `gang_active` whether any pod of the gang still runs, `current`
    the Workload's conditions as stored (kept, but for the ones replaced)."""
    if not gate.installed or gate.queue_name_required_in is not None:
        return []
    return [*_main_actions(job, spec, status, gate, gang_active, priority, now, current),
            *_grow_actions(job, spec, status, gate, gang_active)]


def stray_workload_actions(strays: Sequence[WorkloadView], gang_active: bool,
                           held: bool) -> list[WorkloadAction]:
    """The Workloads of a job whose queue label was removed: it left Kueue, so they go (their
    quota with them). A job the admin's rule then holds (`held`) keeps them until its gang
    stopped, so the quota backs the gang while it saves; one without the rule runs on as an
    unlabelled job does."""
    if held and gang_active:
        return []
    return [DeleteWorkload(w.name, w.resource_version) for w in strays if not w.deleting]


def _grow_actions(job: JobIdentity, spec: TrainingJobSpec | None, status: TrainingJobStatus,
                  gate: QueueGate, gang_active: bool) -> list[WorkloadAction]:
    """The grow Workload exists exactly while a grow waits or is being carried out: made
    when the job asks for more than it runs with, resized or remade when it asks for another
    count, dropped when Kueue evicts it (made again, queued) and, with the gang's own, once
    the gang stopped for the grow."""
    grow = gate.grow
    extra = None if status.phase in ("Succeeded", "Failed") else gate.grow_extra
    if grow is None:
        if extra is None or spec is None:
            return []
        return [CreateWorkload(build_grow_workload(job, spec, gate))]
    if grow.deleting or grow.owner_uid != job.uid:
        return []
    # After the gang stopped for a grow, the request goes only once the gang's own Workload
    # is seen going: while the grow holds its reservation the old admission launches
    # nothing. Deleted first, a request would leave the old Workload admitted at the old
    # count (its own delete refused for a stale resourceVersion, or not yet in the index),
    # and the gang would start again at the size it was just stopped to leave.
    main_going = gate.workload is None or gate.workload.deleting
    stale = (extra is None or grow.true("Evicted") or grow.queue_name not in ("", gate.queue)
             or (grow.podset_hash is not None and gate.podset_hash is not None
                 and grow.podset_hash != gate.podset_hash)
             or (grow.count != extra and grow.true("QuotaReserved"))
             or (gate.grow_reserved and gate.resizing and not gang_active and main_going))
    if stale:
        return [DeleteWorkload(grow.name, grow.resource_version)]
    if grow.count != extra:
        return [ResizeWorkload(grow.name, grow.resource_version, extra)]
    return []


def _main_actions(job: JobIdentity, spec: TrainingJobSpec | None, status: TrainingJobStatus,
                  gate: QueueGate, gang_active: bool, priority: tuple[str, int] | None,
                  now: datetime, current: Sequence[Mapping[str, Any]]) -> list[WorkloadAction]:
    workload = gate.workload
    if workload is None or workload.owner_uid != job.uid:
        if spec is None or status.phase in ("Succeeded", "Failed"):
            return []
        return [CreateWorkload(build_workload(job, spec, gate.queue, spec.replicas, priority))]
    if workload.deleting:
        return []
    finished = status.phase in ("Succeeded", "Failed")
    if finished:
        if workload.true("Finished") or gang_active:
            return []
        reason = "Succeeded" if status.phase == "Succeeded" else "Failed"
        return [FinishWorkload(workload.name, workload.resource_version, _replace(
            current, [_condition("Finished", "True", reason, status.message or reason, now)]))]
    changes = _spec_changes(workload, gate, priority)
    # Marks the deactivation as the job's own, and drops the mark with it.
    marks: dict[str, str | None] = (
        {} if "active" not in changes
        else {SUSPENDED_ANNOTATION: None if changes["active"] else "true"})
    # Suspended: deactivated first; Kueue then evicts it (reason Deactivated), and the
    # release below hands its quota back once the gang stopped.
    if changes.get("active") is False:
        return [PatchWorkloadSpec(workload.name, workload.resource_version, changes, marks)]
    if workload.true("Evicted") and workload.true("QuotaReserved") and not gang_active:
        evicted = workload.conditions["Evicted"]
        requeue = evicted.reason in ("Preempted", "NodeFailures")
        message = f"Released by the job after eviction ({evicted.reason})"
        return [ReleaseQuota(workload.name, workload.resource_version, _replace(current, [
            _condition("QuotaReserved", "False", "Pending", message, now),
            _condition("Admitted", "False", "NoReservation", "The workload has no reservation",
                       now),
            _condition("Requeued", "True" if requeue else "False",
                       "Requeued" if requeue else evicted.reason,
                       "Requeued after eviction" if requeue else evicted.message, now),
            # Admitted again, the gang starts anew: Kueue times that start from the new
            # admission, which a PodsReady left True from before would hide from it.
            _condition(PODS_READY, "False", WAIT_FOR_START,
                       "Not all pods are ready or succeeded", now)]))]
    if gate.resizing and not gang_active:
        return [DeleteWorkload(workload.name, workload.resource_version)]
    reshaped = gate.mismatch == "podset"
    if spec is not None and not workload.true("QuotaReserved") and (
            workload.count != spec.replicas or workload.reclaimable
            or workload.min_count != min_count(spec, spec.replicas) or reshaped):
        return [ResizeWorkload(workload.name, workload.resource_version, spec.replicas,
                               min_count(spec, spec.replicas), bool(workload.reclaimable),
                               pod_set_template(spec) if reshaped else None,
                               gate.podset_hash if reshaped else None,
                               topology_request(spec) if reshaped else None)]
    if changes:
        return [PatchWorkloadSpec(workload.name, workload.resource_version, changes, marks)]
    reclaim = gate.reclaim
    # Once every rank of the smaller gang runs: until then the quota still backs its launch.
    if reclaim is not None and status.phase == "Running" and status.replicas == gate.runs:
        return [ReclaimPods(workload.name, workload.resource_version, reclaim)]
    # Evicted, the release above carries PodsReady (Kueue times no evicted Workload out).
    if workload.true("Evicted"):
        return []
    ready = pods_ready(workload, status.phase == "Running")
    if _pods_ready_changed(workload, ready):
        return [SetPodsReady(workload.name, workload.resource_version, _replace(current, [
            _condition(PODS_READY, ready.status, ready.reason, ready.message, now)]))]
    return []


def _spec_changes(workload: WorkloadView, gate: QueueGate,
                  priority: tuple[str, int] | None) -> dict[str, Any]:
    """The Workload's spec fields that no longer follow the job: spec.active (the job's
    spec.suspend), the queue (only while no quota is held: Kueue refuses it then, and
    `QueueGate.mismatch` remakes the Workload instead), and the priority its label names
    (`priority`: that WorkloadPriorityClass and its value, None where there is no label or
    no such class). Kueue refuses adding or removing a priorityClassRef while quota is held:
    that waits for the next requeue, as jobframework leaves it too."""
    changes: dict[str, Any] = {}
    # Deactivated for the suspension; reactivated only where that was the job's doing.
    if gate.suspended and workload.active:
        changes["active"] = False
    elif not gate.suspended and not workload.active and workload.suspended_by_job:
        changes["active"] = True
    reserved = workload.true("QuotaReserved")
    if workload.queue_name and workload.queue_name != gate.queue and not reserved:
        changes["queueName"] = gate.queue
    have = workload.priority
    if gate.priority_class is None and have is not None and not reserved:
        changes.update(priorityClassRef=None, priority=None)
    elif (priority is not None and priority[0] == gate.priority_class and have != priority
          and (have is not None or not reserved)):
        changes.update(priorityClassRef={"group": GROUP, "kind": "WorkloadPriorityClass",
                                         "name": priority[0]}, priority=priority[1])
    return changes


def _replace(current: Sequence[Mapping[str, Any]], new: Sequence[dict[str, Any]]
             ) -> list[dict[str, Any]]:
    kinds = {c["type"] for c in new}
    kept = [dict(c) for c in current if c.get("type") not in kinds]
    # metav1.Condition: the transition time moves only when the status does.
    before = {c.get("type"): c for c in current}
    merged = []
    for condition in new:
        old = before.get(condition["type"])
        if old is not None and old.get("status") == condition["status"]:
            condition = {**condition, "lastTransitionTime": old.get("lastTransitionTime")}
        merged.append(condition)
    return kept + merged
