"""One observation step: what kopf hands the daemon (its indexes, the job's body) plus the few
reads its indexes do not hold -> the one `Observed` the decision looks at.

The reads go through a `ClusterReader` (the API server and the trainers, reader.py; a fake in
the tests), so the step runs without a server. Nothing here decides: it gathers, caches what
is costly to gather again (the parsed spec, the keys Secret, the gang's carried views, in the
job's `JobState`), and builds the gang once (gang.py) for the decision to reuse.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from tardigrade_contract import contract

from tardigrade_operator import naming
from tardigrade_operator.api.parse import InvalidTrainingJob, parse_spec
from tardigrade_operator.api.types import TrainingJobSpec, TrainingJobStatus
from tardigrade_operator.config import OperatorConfig
from tardigrade_operator.decision import admission, maintenance, queue_name_rule, queueing
from tardigrade_operator.observation import autoscaling, indexlag
from tardigrade_operator.observation.gang import Gang, gang_of
from tardigrade_operator.observation.job_memory import JobState
from tardigrade_operator.observation.observed import Observed
from tardigrade_operator.observation.pods import (
    PodView,
    ServiceView,
    newest_readiness,
    nodes_shutting_down,
    not_ready_since,
    parse_pod,
    parse_service,
)
from tardigrade_operator.observation.progress import Progress
from tardigrade_operator.rendering import keys, netpolicy, tpu_layout
from tardigrade_operator.rendering.manifests import JobRef

JobKey = tuple[str, str]
Workload = tuple[queueing.WorkloadView, list[dict[str, Any]]]
log = logging.getLogger(__name__)


class ClusterReader(Protocol):
    """The reads an observation makes beyond kopf's indexes (reader.KubeReader)."""

    async def list_job_pods(self, namespace: str, job: str) -> list[dict[str, Any]]: ...

    async def read_service(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def list_scale_up_events(self, namespace: str) -> list[dict[str, Any]]: ...

    async def kueue_api(self) -> queueing.KueueApi: ...

    async def fetch_progress(self, gang: Sequence[PodView], token: str | None) -> Progress: ...


@dataclasses.dataclass(frozen=True)
class Indexes:
    """kopf's indexes (handlers.py), as the daemon got them; None: not watched."""

    pods: Mapping[JobKey, Iterable[PodView]]
    services: Mapping[JobKey, Iterable[ServiceView]]
    policies: Mapping[JobKey, Iterable[ServiceView]] | None = None
    nodes: Mapping[str, Iterable[Any]] | None = None  # node_readiness
    maintenance: Mapping[str, Iterable[Any]] | None = None
    pools: Mapping[str, Iterable[str]] | None = None
    kubelets: Mapping[str, Iterable[str]] | None = None
    workloads: Mapping[JobKey, Iterable[Workload]] | None = None
    flavors: Mapping[str, Iterable[queueing.Flavor]] | None = None


@dataclasses.dataclass(frozen=True)
class Observation:
    """The observation, and what the act step needs of how it was made."""

    observed: Observed
    version: str  # the resourceVersion the observed status is valid at
    job_keys: keys.JobKeys | None  # the job's keys, as far as they are known
    polled: Progress | None  # rank 0's answer; None: not read this pass (pacing.py)
    workload: Workload | None  # the job's own Workload, for a job Kueue holds
    # The job's Workloads once its queue label is gone (queueing.stray_workload_actions).
    strays: tuple[queueing.WorkloadView, ...] = ()


async def observe(key: JobKey, uid: str, body: Mapping[str, Any], indexes: Indexes,
                  state: JobState, config: OperatorConfig, reader: ClusterReader,
                  clock: float) -> Observation | None:
    """One pass's observation; None while the pods this operator just created are not in the
    index yet (their events wake the job). `clock` is the loop's monotonic time."""
    namespace, name = key
    meta = body.get("metadata") or {}
    status, version = _known_status(key, meta, body.get("status") or {}, state)
    spec, spec_error = parsed_spec(key, meta, body, config, state)
    nodes_ready = None
    nodes_down: dict[str, datetime] = {}
    shutting_down: frozenset[str] = frozenset()
    if indexes.nodes is not None and len(indexes.nodes) > 0:
        nodes = [(node, list(store)) for node, store in indexes.nodes.items()]
        nodes_ready = newest_readiness(nodes)
        nodes_down = not_ready_since(nodes)
        shutting_down = nodes_shutting_down(nodes)
    pods: list[PodView] = _values(indexes.pods, key)
    gang = gang_of(pods, uid, status, shutting_down, state.in_place.carried)
    if state.created is not None:
        state.created = state.created.saw(p.name for p in gang.pods)
    if status.attempt and len(gang.current) < status.replicas:
        if indexlag.awaiting_own_creates(state.created, gang.attempt,
                                         [p.name for p in gang.current],
                                         status.replicas, clock):
            return None
        # Fewer ranks than launched: before calling them gone, make sure it is not the index
        # lagging (just created, or rebuilt after a peering pause) by asking the API server.
        listed = await reader.list_job_pods(namespace, name)
        pods = [view for view in (parse_pod(p) for p in listed) if view]
        gang = gang_of(pods, uid, status, shutting_down, state.in_place.carried)
    keys_secret, job_keys = await job_keys_of(key, uid, state, reader, clock)
    read = config.pacing_settings().fixed or state.progress.is_due(clock)
    polled = (await reader.fetch_progress(
        gang.current, job_keys.progress_token if job_keys else None) if read else None)
    if polled is not None and polled.refused and state.keys is not None:
        state.keys.checked = float("-inf")  # the Secret may hold other values now
    generation = int(meta.get("generation") or 0)
    rejected = state.rejected
    decision = config.decision_settings()
    gang_active = any(p.active for p in gang.pods)
    workload, gate, strays = await _queue(key, uid, meta, spec, indexes, reader, gang_active)
    if gate is None and queue_name_rule.held_for_queue_name(
            decision.queue_name_rule, namespace, None,
            launched=queue_name_rule.launched_outside_kueue(status)):
        gate = queueing.queue_name_hold(namespace)
    observed = Observed(
        job=JobRef(name=name, namespace=namespace, uid=uid),
        generation=generation,
        spec=spec,
        spec_error=spec_error,
        status=status,
        gang=gang,
        service=await _service(key, uid, status, indexes.services, reader),
        now=datetime.now(UTC),
        progress=polled.report if polled else None,
        progress_error=polled.malformed if polled else None,
        nodes_ready=nodes_ready,
        nodes_not_ready_since=nodes_down,
        nodes_shutting_down=shutting_down,
        settings=decision,
        rejected=rejected[1] if rejected is not None and rejected[0] == generation else None,
        scale_up=await _scale_up_signals(namespace, gang, reader),
        nodes_maintenance=maintenance.scheduled_nodes(
            (node, list(store)) for node, store in (indexes.maintenance or {}).items()),
        node_pools=None if indexes.pools is None else {
            node: pool for node, store in indexes.pools.items() for pool in store},
        # Only restart in place reads these: no per-pass walk over every node without it.
        kubelet_versions={node: max(store) for node, store in (indexes.kubelets or {}).items()
                          if store} if decision.restart_in_place else {},
        keys_secret=keys_secret,
        new_keys=(job_keys or keys.JobKeys.fresh()) if keys_secret is None else None,
        network_policy=policy_present(key, uid, indexes.policies),
        created=_creation_time(meta),
        refused_restarts=state.in_place.refused_in(status.attempt),
        queue=gate,
    )
    return Observation(observed, version, job_keys, polled, workload, strays)


async def _queue(key: JobKey, uid: str, meta: Mapping[str, Any], spec: TrainingJobSpec | None,
                 indexes: Indexes, reader: ClusterReader, gang_active: bool
                 ) -> tuple[Workload | None, queueing.QueueGate | None,
                            tuple[queueing.WorkloadView, ...]]:
    """The job's Workload and Kueue's hold on the job; for a job without the queue label, no
    gate and the Workloads it still owns (its label was removed)."""
    labels = meta.get("labels") or {}
    queue = queueing.queue_name(labels)
    ours = [w for w in _values(indexes.workloads or {}, key) if w[0].owner_uid == uid]
    if queue is None:
        return None, None, tuple(w[0] for w in ours)
    workload = next((w for w in ours if w[0].role != queueing.GROW_ROLE), None)
    grow = next((w[0] for w in ours if w[0].role == queueing.GROW_ROLE), None)
    flavors = {n: f for n, store in (indexes.flavors or {}).items() for f in store}
    gate = queueing.gate_for(queue, workload[0] if workload else None, flavors,
                             spec.replicas if spec is not None else None, grow,
                             kueue=await reader.kueue_api(), spec=spec,
                             gang_active=gang_active,
                             priority_class=labels.get(queueing.PRIORITY_LABEL) or None)
    return workload, gate, ()


async def _scale_up_signals(namespace: str, gang: Gang, reader: ClusterReader
                            ) -> dict[str, autoscaling.ScaleUpSignal]:
    """The autoscaler's newest verdict on each rank of the gang; read only while some rank is
    unschedulable, so a training gang costs no event lists."""
    current = gang.current
    if not any(p.unschedulable_since is not None and not p.node_name for p in current):
        return {}
    names = {p.name for p in current}
    try:
        events = await reader.list_scale_up_events(namespace)
    except ApiException as err:
        # Without events the unschedulable timeout alone decides: still bounded, only slower.
        log.warning("%s: cannot list autoscaler events: %s", namespace, err.reason)
        return {}
    signals = autoscaling.newest_signals(events)
    return {name: signal for name, signal in signals.items() if name in names}


async def _service(key: JobKey, uid: str, status: TrainingJobStatus,
                   services: Mapping[JobKey, Iterable[ServiceView]], reader: ClusterReader
                   ) -> ServiceView | None:
    """The Service with the job's name. The index holds only Services with our job label; one
    made by someone else lacks it, and a create would just answer AlreadyExists, so until the
    index shows ours the API server is asked."""
    name = naming.service_name(key[1])
    seen = [s for s in _values(services, key) if s.name == name]
    ours = next((s for s in seen if s.owner_uid == uid), None)
    if ours is not None or status.phase in ("Succeeded", "Failed"):
        return ours or (seen[0] if seen else None)
    found = await reader.read_service(key[0], name)
    return parse_service(found) if found is not None else None


async def job_keys_of(key: JobKey, uid: str, state: JobState, reader: ClusterReader,
                      clock: float) -> tuple[ServiceView | None, keys.JobKeys | None]:
    """Who owns the Secret with the job's keys' name (None: there is none), and the job's keys:
    those in its own Secret, else those this operator made for it before (a Secret deleted
    under a running gang is made again with the values its trainers hold). Read with one GET
    at most every keys.RECHECK_SECONDS (sooner after a refusal): the operator may not watch
    Secrets."""
    cached = state.keys
    if cached is None or cached.due(uid, clock):
        found = await reader.read_secret(key[0], naming.keys_secret_name(key[1]))
        view = parse_service(found) if found is not None else None
        known = cached.keys if cached is not None and cached.uid == uid else None
        if view is not None and view.owner_uid == uid:
            known = keys.read_keys(found or {}) or known
        elif view is not None:
            known = None  # someone else's: never read, never sent
        cached = state.keys = keys.KeysCache(uid, clock, view, known)
    return cached.found, cached.keys


def policy_present(key: JobKey, uid: str,
                   policies: Mapping[JobKey, Iterable[ServiceView]] | None) -> bool | None:
    """Whether the job's own NetworkPolicy exists; None when they are not watched."""
    if policies is None:
        return None
    name = netpolicy.policy_name(key[1])
    return any(p.name == name and p.owner_uid == uid for p in _values(policies, key))


def parsed_spec(key: JobKey, meta: Mapping[str, Any], body: Mapping[str, Any],
                config: OperatorConfig, state: JobState
                ) -> tuple[TrainingJobSpec | None, str | None]:
    """Parse (and CEL-check) the spec once per generation, not on every pass."""
    generation = meta.get("generation")
    cached = state.spec
    if cached is not None and cached[0] == generation:
        return cached[1], cached[2]
    try:
        spec, error = parse_spec(dict(body.get("spec") or {})), None
    except InvalidTrainingJob as err:
        spec, error = None, "; ".join(str(e) for e in err.errors)
    if spec is not None:
        # What the cluster admin does not let a job's pods do is as invalid as a typo.
        job = JobRef(name=key[1], namespace=key[0], uid=str(meta.get("uid") or ""))
        forbidden = admission.review(job, spec, config.admission)
        if forbidden:
            spec, error = None, "; ".join(str(e) for e in forbidden)
    if spec is not None and (why := tpu_layout.job_name_error(str(meta.get("name")), spec)):
        spec, error = None, why
    state.spec = (generation, spec, error)
    return spec, error


def _known_status(key: JobKey, meta: Mapping[str, Any], raw: dict[str, Any], state: JobState
                  ) -> tuple[TrainingJobStatus, str]:
    """The status to decide on, and the resourceVersion it is valid at: ours from the last
    write (or fresh read) until the watch has caught up.

    Deciding twice on a stale status would count one preemption twice.
    """
    written = state.written
    if written is not None:
        version, status = written
        if _older(resource_version(meta), version):
            return status, version
        state.written = None
    return parse_status(key, raw), resource_version(meta)


def parse_status(key: JobKey, raw: dict[str, Any]) -> TrainingJobStatus:
    try:
        return TrainingJobStatus.model_validate(raw)
    except ValidationError:
        log.warning("%s/%s: unreadable status, rebuilding it", *key)
        return TrainingJobStatus()


def resource_version(meta: Mapping[str, Any]) -> str:
    return str(meta.get("resourceVersion") or "")


def _older(seen: str, written: str) -> bool:
    # resourceVersions are opaque, but every API server we target (etcd revisions, the local
    # one's counter) issues increasing integers; anything else falls back to equality.
    if seen.isdigit() and written.isdigit():
        return int(seen) < int(written)
    return False


def _values(index: Mapping[Any, Iterable[Any]], key: Any) -> list[Any]:
    return list(index.get(key, []))


def _creation_time(meta: Any) -> datetime | None:
    """metadata.creationTimestamp, set by the API server; None where it is missing or odd."""
    try:
        created = contract.parse_time(meta.get("creationTimestamp"))
    except (TypeError, ValueError):
        return None
    return created if created is not None and created.tzinfo is not None else None
