"""kopf wiring: indexes feed observe -> decide -> apply. Nothing here decides anything.

One daemon per TrainingJob runs the reconcile loop; events about the job, its pods and their
nodes wake it, and pacing.py says how long it may sleep otherwise, so a missed event costs at
most one settled interval and never a wrong decision (level-triggered).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import kopf
import prometheus_client
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from tardigrade_operator import (
    admission,
    apidecode,
    autoscaling,
    finalizers,
    indexlag,
    keys,
    maintenance,
    metrics,
    multislice,
    naming,
    netpolicy,
    pacing,
    queueing,
    restart_in_place,
    slices,
    watchdog,
)
from tardigrade_operator.api import types
from tardigrade_operator.api.parse import InvalidTrainingJob, parse_spec
from tardigrade_operator.api.types import TrainingJobSpec, TrainingJobStatus
from tardigrade_operator.config import OperatorConfig
from tardigrade_operator.decide import Observed, Plan, decide
from tardigrade_operator.jobstate import JobState
from tardigrade_operator.kube import (
    ChildRejected,
    ClusterWriter,
    KeysSecretTaken,
    StaleStatus,
    load_client_config,
)
from tardigrade_operator.observe import (
    NODE_SHUTTING_DOWN_MESSAGE,
    NodeReadiness,
    PodView,
    ServiceView,
    newest_readiness,
    nodes_shutting_down,
    not_ready_since,
    owned,
    parse_pod,
    parse_service,
)
from tardigrade_operator.podhttp import pod_session
from tardigrade_operator.progress import Progress, fetch_progress
from tardigrade_operator.render import JobRef
from tardigrade_operator.restart_request import request_restart

# kopf's finalizer name. No TrainingJob carries it any more (see `_needs_no_finalizer`); kopf
# removes it from jobs that an older operator version gave it.
JOB_FINALIZER = f"{types.GROUP}/operator"
JobKey = tuple[str, str]


# kopf logs "Handler 'pod_changed' succeeded." at INFO for every event: thousands of lines per
# recovery of a large gang, saying only that a job was woken. Failures are still logged.
_ROUTINE = frozenset(f"Handler {name!r} succeeded." for name in (
    "pod_changed", "node_changed", "job_changed"))


def _not_routine(record: logging.LogRecord) -> bool:
    return record.getMessage() not in _ROUTINE


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Before kopf starts its watch streams (they wait for the startup handlers).
    watchdog.track_tasks(asyncio.get_running_loop())
    logging.getLogger("kopf.objects").addFilter(_not_routine)
    config = OperatorConfig.from_env()
    settings.persistence.finalizer = JOB_FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=types.GROUP)
    settings.persistence.diffbase_storage = apidecode.TolerantDiffBaseStorage(
        prefix=types.GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    settings.peering.lifetime = int(config.peering_lifetime_seconds)
    # Reconnect watches regularly so a silently dropped connection is noticed.
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    memo.config = config
    memo.jobs = {}  # (namespace, name) -> JobState
    # node name -> (Ready, maintenance label) as last seen: which changes wake its jobs.
    memo.nodes_seen = {}
    # uids of deleted jobs whose daemon has yet to notice and stop.
    memo.gone = set()
    memo.session = pod_session()
    load_client_config()
    memo.writer = ClusterWriter(token_review_binding=config.token_review_binding)
    if config.metrics_port:
        prometheus_client.start_http_server(config.metrics_port)


@kopf.on.probe(id="watch_streams")
def watch_streams(**_: Any) -> str:
    """Fails /healthz once a watch stream has died: kopf never restarts one, and without it
    no job of that kind is reconciled again."""
    dead = watchdog.dead_watchers()
    if dead:
        raise kopf.PermanentError(f"watch streams stopped: {'; '.join(dead)}; the operator "
                                  f"must restart")
    return "ok"


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    await memo.session.close()


@kopf.index("pods", labels={naming.LABEL_JOB: kopf.PRESENT})
def gang_pods(namespace: str, labels: kopf.Labels, body: kopf.Body,
              **_: Any) -> dict[JobKey, PodView]:
    # Parsed once per event, not on every pass: a pass reads the whole gang, and a thousand
    # pods parsed per pass cost the operator seconds of each recovery.
    view = parse_pod(body)
    return {} if view is None else {(namespace, labels[naming.LABEL_JOB]): view}


@kopf.index("services", labels={naming.LABEL_JOB: kopf.PRESENT})
def gang_services(namespace: str, labels: kopf.Labels, body: kopf.Body,
                  **_: Any) -> dict[JobKey, ServiceView]:
    return {(namespace, labels[naming.LABEL_JOB]): parse_service(body)}


@kopf.index("networking.k8s.io", "v1", "networkpolicies",
            labels={naming.LABEL_JOB: kopf.PRESENT})
def gang_policies(namespace: str, name: str, labels: kopf.Labels, body: kopf.Body,
                  **_: Any) -> dict[JobKey, ServiceView]:
    """The jobs' NetworkPolicies: one that went missing is made again (decide.py)."""
    return {(namespace, labels[naming.LABEL_JOB]): parse_service(body)}


@kopf.on.event("services", labels={naming.LABEL_JOB: kopf.PRESENT})
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies",
               labels={naming.LABEL_JOB: kopf.PRESENT})
def isolation_changed(type: str | None, namespace: str, labels: kopf.Labels, memo: kopf.Memo,
                      **_: Any) -> None:
    """A job's Service or NetworkPolicy was deleted: its job makes it again at once rather
    than at its next settled pass."""
    if type == "DELETED":
        _wake(memo, (namespace, labels[naming.LABEL_JOB]), news=False)


def node_readiness(name: str, status: kopf.Status, meta: kopf.Meta,
                   **_: Any) -> dict[str, NodeReadiness]:
    conditions = status.get("conditions") or []
    condition = next((c for c in conditions if c.get("type") == "Ready"), {})
    ready = condition.get("status") == "True"
    version = str(meta.get("resourceVersion") or "")
    since = str(condition.get("lastTransitionTime") or "")
    shutting_down = not ready and condition.get("message") == NODE_SHUTTING_DOWN_MESSAGE
    return {name: (int(version) if version.isdigit() else 0, ready, since, shutting_down)}


def node_maintenance(name: str, labels: kopf.Labels, meta: kopf.Meta,
                     **_: Any) -> dict[str, maintenance.MaintenanceEntry]:
    version = str(meta.get("resourceVersion") or "")
    value = str(labels.get(maintenance.SCHEDULED_MAINTENANCE_LABEL, ""))
    return {name: (int(version) if version.isdigit() else 0, value)}


def node_pool(name: str, labels: kopf.Labels, **_: Any) -> dict[str, str]:
    return {name: str(labels[slices.NODE_POOL_LABEL])}


def node_kubelet(name: str, status: kopf.Status, **_: Any) -> dict[str, str]:
    return {name: str((status.get("nodeInfo") or {}).get("kubeletVersion") or "")}


def node_changed(type: str | None, name: str, status: kopf.Status, labels: kopf.Labels,
                 memo: kopf.Memo, gang_pods: kopf.Index, node_pool: kopf.Index | None = None,
                 **_: Any) -> None:
    """Wakes the jobs with a pod on the node when its readiness or scheduled maintenance
    changed: a settled job does not pass on a timer, and both feed its decisions. Maintenance
    on a node also wakes the jobs with a pod in its node pool: a TPU slice goes whole."""
    conditions = status.get("conditions") or []
    ready = next((c.get("status") for c in conditions if c.get("type") == "Ready"), None)
    scheduled = labels.get(maintenance.SCHEDULED_MAINTENANCE_LABEL)
    seen = None if type == "DELETED" else (ready, scheduled)
    before = memo.nodes_seen.get(name)
    if before == seen:
        return
    memo.nodes_seen[name] = seen
    nodes = {name}
    pool = labels.get(slices.NODE_POOL_LABEL)
    if pool and node_pool is not None and (before or (None, None))[1] != scheduled:
        nodes |= {node for node, store in node_pool.items() if pool in store}
    for key, pods in gang_pods.items():
        if any(pod.node_name in nodes for pod in pods):
            _wake(memo, key)


if os.environ.get("TARDIGRADE_WATCH_NODES", "true").lower() != "false":
    kopf.index("nodes", id="node_readiness")(node_readiness)
    # Where a TPU slice's leader landed: its followers are pinned to that pool.
    kopf.index("nodes", id="node_pool",
               labels={slices.NODE_POOL_LABEL: kopf.PRESENT})(node_pool)
    kopf.index("nodes", id="node_kubelet")(node_kubelet)
    # Only nodes that carry the label: kopf drops a node from the index once it is removed.
    kopf.index("nodes", id="node_maintenance",
               labels={maintenance.SCHEDULED_MAINTENANCE_LABEL: kopf.PRESENT})(node_maintenance)
    kopf.on.event("nodes", id="node_changed")(node_changed)


@kopf.index(types.GROUP, types.VERSION, types.PLURAL)
def live_jobs(namespace: str, name: str, uid: str, meta: kopf.Meta,
              **_: Any) -> dict[JobKey, str]:
    """uid of every job not being deleted: whose pods still need their tracking finalizer."""
    return {} if meta.get("deletionTimestamp") else {(namespace, name): uid}


# Kueue's objects, for jobs labelled kueue.x-k8s.io/queue-name (queueing.py). Where Kueue's CRDs
# are absent kopf serves none of these (it warns "Unresolved resources"): jobs without the
# label run as ever, a labelled one is held and says Kueue is missing or too old
# (ClusterWriter.kueue_api).
@kopf.index(queueing.GROUP, queueing.VERSION, queueing.WORKLOADS,
            labels={naming.LABEL_JOB: kopf.PRESENT})
def job_workloads(namespace: str, labels: kopf.Labels, body: kopf.Body,
                  **_: Any) -> dict[JobKey, tuple[queueing.WorkloadView, list[dict[str, Any]]]]:
    conditions = [dict(c) for c in (body.get("status") or {}).get("conditions") or []]
    return {(namespace, labels[naming.LABEL_JOB]): (queueing.parse_workload(body), conditions)}


@kopf.index(queueing.GROUP, queueing.VERSION, queueing.FLAVORS)
def resource_flavors(name: str, body: kopf.Body, **_: Any) -> dict[str, queueing.Flavor]:
    return {name: queueing.parse_flavor(body)}


@kopf.on.event(queueing.GROUP, queueing.VERSION, queueing.WORKLOADS,
               labels={naming.LABEL_JOB: kopf.PRESENT})
def workload_changed(namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    """Kueue admitted, evicted or requeued a job's Workload: its job decides again."""
    _wake(memo, (namespace, labels[naming.LABEL_JOB]))


@kopf.on.event("pods", labels={naming.LABEL_JOB: kopf.PRESENT})
async def pod_changed(type: str | None, namespace: str, labels: kopf.Labels, body: kopf.Body,
                      memo: kopf.Memo, live_jobs: kopf.Index, **_: Any) -> None:
    # Async: kopf runs a sync handler in its thread pool, a hop per pod event that a gang of
    # a thousand pods pays a thousand times per recovery; this one only wakes a job.
    key = (namespace, labels[naming.LABEL_JOB])
    _wake(memo, key)
    # Pods left behind by a job deleted while no operator ran are found here, at the initial
    # listing; the API server has the last word before one is released.
    if type != "DELETED" and finalizers.orphaned(body, _values(live_jobs, key)):
        await asyncio.to_thread(memo.writer.release_orphan, namespace, body)


@kopf.on.event(types.GROUP, types.VERSION, types.PLURAL)
def job_changed(type: str | None, namespace: str, name: str, uid: str, meta: kopf.Meta,
                memo: kopf.Memo, **_: Any) -> None:
    key = (namespace, name)
    if type == "DELETED" or meta.get("deletionTimestamp"):
        # Its pods need no tracking now: let the garbage collector take them.
        memo.gone.add(uid)
        memo.writer.release_all(namespace, name, uid)
        metrics.forget(key)
        _wake(memo, key)  # its daemon stops at once
        memo.jobs.pop(key, None)
        return
    state = memo.jobs.get(key)
    echo = state is not None and state.echoes_our_write(_resource_version(meta))
    if echo and not memo.config.pacing_settings().fixed:
        return
    new_spec = state is not None and (state.spec is None
                                      or state.spec[0] != meta.get("generation"))
    _wake(memo, key, news=new_spec)


@kopf.daemon(types.GROUP, types.VERSION, types.PLURAL, initial_delay=0,
             cancellation_timeout=10)
async def keep_gang(stopped: kopf.DaemonStopped, name: str, namespace: str, uid: str,
                    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger,
                    gang_pods: kopf.Index, gang_services: kopf.Index, **kwargs: Any) -> None:
    key = (namespace, name)
    state: JobState = memo.jobs.setdefault(key, JobState())
    nodes: kopf.Index | None = kwargs.get("node_readiness")
    scheduled: kopf.Index | None = kwargs.get("node_maintenance")
    pools: kopf.Index | None = kwargs.get("node_pool")
    settings: pacing.PacingSettings = memo.config.pacing_settings()
    clock = asyncio.get_running_loop().time
    failures = 0
    while not stopped and uid not in memo.gone:
        if state.news:
            state.progress = state.progress.reset(clock())
        state.news = False
        state.wake.clear()
        began = clock()
        started = time.perf_counter()
        sleep = settings.busy_seconds
        try:
            sleep = await reconcile(key, uid, body, memo, gang_pods, gang_services, nodes,
                                    scheduled, state, began, pools,
                                    kwargs.get("node_kubelet"), kwargs.get("job_workloads"),
                                    kwargs.get("resource_flavors"),
                                    kwargs.get("gang_policies"))
            failures = 0
        except Exception:
            # Never crash-loop on one object: log, and a later pass retries from scratch.
            failures += 1
            logger.exception("reconcile of %s/%s failed; retrying", namespace, name)
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
        if failures:
            # Back off, deaf to wake-ups: a failing API server should not be hammered once
            # per pod event.
            await stopped.wait(retry_delay(failures, memo.config.resync_seconds))
            continue
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.wake.wait(), timeout=sleep)
    memo.gone.discard(uid)


def _needs_no_finalizer(daemon: Any) -> None:
    """Register `daemon` without the finalizer kopf gives every object that has a daemon.

    kopf keeps the object until the daemon has stopped (nolar/kopf#833); with no operator
    running, that finalizer blocks `kubectl delete` of the job and the deletion of its
    namespace forever. This daemon needs no such guarantee: it stops on the job's DELETED event
    (`memo.gone`), a pass still running then can only create pods owned by a uid that no longer
    exists, which the garbage collector deletes, and checkpoints are never touched. kopf has no
    public switch for this, hence the registry edit.
    """
    spawning = kopf.get_default_registry()._spawning
    spawning._handlers = [dataclasses.replace(h, requires_finalizer=False) if h.fn is daemon
                          else h for h in spawning._handlers]


_needs_no_finalizer(keep_gang)
# Before kopf's first request (its API discovery precedes the startup handlers).
apidecode.install_in_kopf()


async def reconcile(key: JobKey, uid: str, body: kopf.Body, memo: kopf.Memo,
                    pods_index: kopf.Index, services_index: kopf.Index,
                    nodes_index: kopf.Index | None,
                    maintenance_index: kopf.Index | None, state: JobState,
                    clock: float, pools_index: kopf.Index | None = None,
                    kubelet_index: kopf.Index | None = None,
                    workloads_index: kopf.Index | None = None,
                    flavors_index: kopf.Index | None = None,
                    policies_index: kopf.Index | None = None) -> float:
    """One pass; returns the seconds the loop may sleep unless woken (pacing.py). `clock` is
    the loop's monotonic time at the start of the pass."""
    namespace, name = key
    meta = body.get("metadata") or {}
    status, version = _known_status(key, meta, body.get("status") or {}, state)
    spec, spec_error = _parsed_spec(key, meta, body, memo, state)
    pods: list[PodView] = _values(pods_index, key)
    mine = restart_in_place.carried(owned(pods, uid), status, state.carried)
    attempt = max([status.attempt, *(p.attempt for p in mine)])
    if state.created is not None:
        state.created = state.created.saw(p.name for p in mine)
    if status.attempt and sum(p.attempt == attempt for p in mine) < status.replicas:
        if indexlag.awaiting_own_creates(state.created, attempt,
                                         [p.name for p in mine if p.attempt == attempt],
                                         status.replicas, clock):
            # Our own creates, not yet in the index: their events wake the job.
            return memo.config.pacing_settings().busy_seconds
        # Fewer ranks than launched: before calling them gone, make sure it is not the index
        # lagging (just created, or rebuilt after a peering pause) by asking the API server.
        listed = await asyncio.to_thread(memo.writer.list_job_pods, namespace, name)
        pods = [view for view in (parse_pod(p) for p in listed) if view]
        mine = restart_in_place.carried(owned(pods, uid), status, state.carried)
        attempt = max([status.attempt, *(p.attempt for p in mine)])
    gang: list[PodView] = [p for p in mine if p.attempt == attempt]
    settings: pacing.PacingSettings = memo.config.pacing_settings()
    keys_secret, job_keys = await _job_keys(key, uid, state, memo, clock)
    read = settings.fixed or state.progress.is_due(clock)
    fetched = (await fetch_progress(memo.session, gang, memo.config.progress_timeout_seconds,
                                    token=job_keys.progress_token if job_keys else None)
               if read else Progress())
    if fetched.refused and state.keys is not None:
        state.keys.checked = float("-inf")  # the Secret may hold other values now
    nodes_ready = None
    nodes_down: dict[str, datetime] = {}
    shutting_down: frozenset[str] = frozenset()
    if nodes_index is not None and len(nodes_index) > 0:
        nodes_ready = newest_readiness((node, list(store)) for node, store in nodes_index.items())
        nodes_down = not_ready_since((node, list(store)) for node, store in nodes_index.items())
        shutting_down = nodes_shutting_down(
            (node, list(store)) for node, store in nodes_index.items())
    scheduled = maintenance.scheduled_nodes(
        (node, list(store)) for node, store in (maintenance_index or {}).items())
    generation = int(meta.get("generation") or 0)
    rejected = state.rejected
    scale_up = await _scale_up_signals(namespace, gang, memo)
    decision = memo.config.decision_settings()
    queue = queueing.queue_name(meta.get("labels") or {})
    workload: tuple[queueing.WorkloadView, list[dict[str, Any]]] | None = None
    gate = None
    if queue is not None:
        ours = [w for w in _values(workloads_index or {}, key) if w[0].owner_uid == uid]
        workload = next((w for w in ours if w[0].role != queueing.GROW_ROLE), None)
        grow = next((w[0] for w in ours if w[0].role == queueing.GROW_ROLE), None)
        flavors = {n: f for n, store in (flavors_index or {}).items() for f in store}
        gate = queueing.gate_for(queue, workload[0] if workload else None, flavors,
                                 spec.replicas if spec is not None else None, grow,
                                 kueue=await asyncio.to_thread(memo.writer.kueue_api))
    observed = Observed(
        job=JobRef(name=name, namespace=namespace, uid=uid),
        generation=generation,
        spec=spec,
        spec_error=spec_error,
        status=status,
        # Ours already carried (with the memo: decide's own carrying then changes nothing).
        pods=[*mine, *(p for p in pods if p.owner_uid != uid)],
        service=await _service(key, uid, status, services_index, memo),
        now=datetime.now(UTC),
        progress=fetched.report,
        progress_error=fetched.malformed,
        nodes_ready=nodes_ready,
        nodes_not_ready_since=nodes_down,
        nodes_shutting_down=shutting_down,
        settings=decision,
        rejected=rejected[1] if rejected is not None and rejected[0] == generation else None,
        scale_up=scale_up,
        nodes_maintenance=scheduled,
        node_pools=None if pools_index is None else {
            node: pool for node, store in pools_index.items() for pool in store},
        # Only restart in place reads these: no per-pass walk over every node without it.
        kubelet_versions={node: max(store) for node, store in (kubelet_index or {}).items()
                          if store} if decision.restart_in_place else {},
        keys_secret=keys_secret,
        new_keys=(job_keys or keys.JobKeys.fresh()) if keys_secret is None else None,
        network_policy=_policy_present(key, uid, policies_index),
        refused_restarts=state.refused_in(status.attempt),
        queue=gate,
    )
    plan = decide(observed)
    plan.patch_pods = state.unsent(plan.patch_pods, plan.status.attempt, {p.name for p in mine})
    if plan.restart_in_place:
        # A recovery is rare, and a stale key would have the kept ranks recreated: read anew.
        state.keys = None
        _, job_keys = await _job_keys(key, uid, state, memo, clock)
    try:
        written = await asyncio.to_thread(
            memo.writer.apply, namespace, name, status, plan, version,
            _asker(memo, plan, state, job_keys.restart_key if job_keys else None))
    except StaleStatus:
        # Decide again at once, on the job as the API server has it now.
        fresh = await asyncio.to_thread(memo.writer.read_job, namespace, name)
        state.written = (_resource_version(fresh.get("metadata") or {}),
                         _parse_status(key, fresh.get("status") or {}))
        state.wake.set()
        return 0.0
    except ChildRejected as err:
        # Retrying the same spec would be refused again (and hammer the API server); the next
        # pass records the refusal in status and stops there.
        logging.getLogger(__name__).warning("%s/%s: %s", namespace, name, err)
        state.rejected = (generation, str(err))
        state.wake.set()
        return 0.0
    except KeysSecretTaken as err:
        # Read it again: the next pass holds the job (decide.py, SecretNameTaken).
        logging.getLogger(__name__).warning("%s/%s: %s", namespace, name, err)
        state.keys = None
        state.wake.set()
        return 0.0
    if plan.create_keys_secret is not None and observed.new_keys is not None:
        # Ours now, with these values: a later pass need not read them back.
        state.keys = keys.KeysCache(uid, clock, ServiceView(
            naming.keys_secret_name(name), uid, "this TrainingJob"), observed.new_keys)
    if written is not None:
        state.written = (written, plan.status)
    state.sent(plan.patch_pods, plan.status.attempt)
    if plan.create_pods:
        # The grace counts from the last answer, not from the pass's start: at a thousand
        # ranks a pass's writes alone can take longer than the grace.
        state.created = indexlag.created(plan.create_pods, asyncio.get_running_loop().time())
    for event in plan.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    if gate is not None:
        await _write_workload(key, uid, meta, spec, plan, gate, workload, mine, memo)
    metrics.record_transition(key, status, plan.status)
    return _next_pass(observed, plan, state, read, fetched, clock, memo, settings)


async def _write_workload(key: JobKey, uid: str, meta: Any, spec: TrainingJobSpec | None,
                          plan: Plan, gate: queueing.QueueGate,
                          workload: tuple[queueing.WorkloadView, list[dict[str, Any]]] | None,
                          pods: list[PodView], memo: kopf.Memo) -> None:
    """Carry out the Workload writes this pass's outcome asks for (queueing.workload_actions)."""
    namespace, name = key
    priority = None
    priority_class = (meta.get("labels") or {}).get(queueing.PRIORITY_LABEL)
    if workload is None and priority_class:
        value = await asyncio.to_thread(memo.writer.priority_value, priority_class)
        priority = None if value is None else (priority_class, value)
    actions = queueing.workload_actions(
        queueing.JobIdentity(name, namespace, uid), spec, plan.status, gate,
        any(p.active for p in pods), priority, datetime.now(UTC),
        workload[1] if workload else ())
    for action in actions:
        await asyncio.to_thread(memo.writer.apply_workload, namespace, action)


def _asker(memo: kopf.Memo, plan: Plan, state: JobState,
           key: str | None) -> Callable[[], None] | None:
    """The plan's restart-in-place requests, all at once, with the job's restart key `key`
    (None: the job's Secret is missing or not the job's, so none can be taken), for the writer
    to send from its thread between its deletes and its creates (kube.py: the requests carry
    the worlds).
    The kept ranks that did not take theirs are remembered: the next pass, at once, recreates
    them, or asks rank 0 again (restart_in_place.recreate_refused, ask_again)."""
    if not plan.restart_in_place:
        return None
    loop = asyncio.get_running_loop()
    triggers = plan.restart_in_place
    attempt = plan.status.attempt

    async def ask() -> None:
        accepted = (await asyncio.gather(*(request_restart(memo.session, trigger, key)
                                           for trigger in triggers))
                    if key is not None else [False] * len(triggers))
        asked = frozenset(t.pod for t in triggers if t.world is not None)
        if state.answered(attempt, asked, restart_in_place.refused(triggers, accepted)):
            state.wake.set()

    return lambda: asyncio.run_coroutine_threadsafe(ask(), loop).result()


def _next_pass(observed: Observed, plan: Plan, state: JobState, read: bool, fetched: Progress,
               clock: float, memo: kopf.Memo, settings: pacing.PacingSettings) -> float:
    busy = not pacing.settled(observed, plan)
    if read:
        news = pacing.report_news(fetched.report, fetched.malformed)
        state.progress = state.progress.after_read(clock, news, busy, settings, random.random())
    deadline = pacing.next_deadline(
        observed, plan, timedelta(seconds=memo.config.grow_back_after_seconds))
    deadline_in = (deadline - observed.now).total_seconds() if deadline is not None else None
    return pacing.seconds_to_next_pass(clock, state.progress, busy, deadline_in, settings,
                                       again=pacing.decided_anew(observed, plan))


async def _scale_up_signals(namespace: str, gang: list[PodView], memo: kopf.Memo
                            ) -> dict[str, autoscaling.ScaleUpSignal]:
    """The autoscaler's newest verdict on each rank of the gang; read only while some rank is
    unschedulable, so a training gang costs no event lists."""
    if not any(p.unschedulable_since is not None and not p.node_name for p in gang):
        return {}
    names = {p.name for p in gang}
    try:
        events = await asyncio.to_thread(memo.writer.list_scale_up_events, namespace)
    except ApiException as err:
        # Without events the unschedulable timeout alone decides: still bounded, only slower.
        logging.getLogger(__name__).warning("%s: cannot list autoscaler events: %s",
                                            namespace, err.reason)
        return {}
    signals = autoscaling.newest_signals(events)
    return {name: signal for name, signal in signals.items() if name in names}


async def _service(key: JobKey, uid: str, status: TrainingJobStatus,
                   services_index: kopf.Index, memo: kopf.Memo) -> ServiceView | None:
    """The Service with the job's name. The index holds only Services with our job label; one
    made by someone else lacks it, and a create would just answer AlreadyExists, so until the
    index shows ours the API server is asked."""
    name = naming.service_name(key[1])
    seen = [s for s in _values(services_index, key) if s.name == name]
    ours = next((s for s in seen if s.owner_uid == uid), None)
    if ours is not None or status.phase in ("Succeeded", "Failed"):
        return ours or (seen[0] if seen else None)
    found = await asyncio.to_thread(memo.writer.read_service, key[0], name)
    return parse_service(found) if found is not None else None


async def _job_keys(key: JobKey, uid: str, state: JobState, memo: kopf.Memo, clock: float
                   ) -> tuple[ServiceView | None, keys.JobKeys | None]:
    """Who owns the Secret with the job's keys' name (None: there is none), and the job's keys:
    those in its own Secret, else those this operator made for it before (a Secret deleted
    under a running gang is made again with the values its trainers hold). Read with one GET
    at most every keys.RECHECK_SECONDS (sooner after a refusal): the operator may not watch
    Secrets."""
    cached = state.keys
    if cached is None or cached.due(uid, clock):
        found = await asyncio.to_thread(memo.writer.read_secret, key[0],
                                        naming.keys_secret_name(key[1]))
        view = parse_service(found) if found is not None else None
        known = cached.keys if cached is not None and cached.uid == uid else None
        if view is not None and view.owner_uid == uid:
            known = keys.read_keys(found or {}) or known
        elif view is not None:
            known = None  # someone else's: never read, never sent
        cached = state.keys = keys.KeysCache(uid, clock, view, known)
    return cached.found, cached.keys


def _policy_present(key: JobKey, uid: str, policies_index: kopf.Index | None) -> bool | None:
    """Whether the job's own NetworkPolicy exists; None when they are not watched."""
    if policies_index is None:
        return None
    name = netpolicy.policy_name(key[1])
    return any(p.name == name and p.owner_uid == uid for p in _values(policies_index, key))


def _parsed_spec(key: JobKey, meta: Any, body: kopf.Body, memo: kopf.Memo, state: JobState
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
        forbidden = admission.review(job, spec, memo.config.admission)
        if forbidden:
            spec, error = None, "; ".join(str(e) for e in forbidden)
    if spec is not None and (why := multislice.job_name_error(str(meta.get("name")), spec)):
        spec, error = None, why
    state.spec = (generation, spec, error)
    return spec, error


def _known_status(key: JobKey, meta: Any, raw: dict[str, Any], state: JobState
                  ) -> tuple[TrainingJobStatus, str]:
    """The status to decide on, and the resourceVersion it is valid at: ours from the last
    write (or fresh read) until the watch has caught up.

    Deciding twice on a stale status would count one preemption twice.
    """
    written = state.written
    if written is not None:
        version, status = written
        if _older(_resource_version(meta), version):
            return status, version
        state.written = None
    return _parse_status(key, raw), _resource_version(meta)


def _parse_status(key: JobKey, raw: dict[str, Any]) -> TrainingJobStatus:
    try:
        return TrainingJobStatus.model_validate(raw)
    except ValidationError:
        logging.getLogger(__name__).warning("%s/%s: unreadable status, rebuilding it", *key)
        return TrainingJobStatus()


def _resource_version(meta: Any) -> str:
    return str(meta.get("resourceVersion") or "")


def _older(seen: str, written: str) -> bool:
    # resourceVersions are opaque, but every API server we target (etcd revisions, the local
    # one's counter) issues increasing integers; anything else falls back to equality.
    if seen.isdigit() and written.isdigit():
        return int(seen) < int(written)
    return False


def _values(index: kopf.Index, key: JobKey) -> list[Any]:
    return list(index.get(key, []))


def retry_delay(failures: int, resync_seconds: float) -> float:
    """Exponential backoff after consecutive failed passes, capped at a few resyncs."""
    return min(0.5 * 2 ** (failures - 1), max(30.0, 3 * resync_seconds))


def _wake(memo: kopf.Memo, key: JobKey, news: bool = True) -> None:
    state = getattr(memo, "jobs", {}).get(key)
    if state is not None:
        state.news = state.news or news
        state.wake.set()
