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
from datetime import UTC, datetime, timedelta
from typing import Any

import kopf
import prometheus_client

from tardigrade_operator import (
    apidecode,
    finalizers,
    metrics,
    naming,
    watchdog,
)
from tardigrade_operator.api import types
from tardigrade_operator.api.types import TrainingJobSpec
from tardigrade_operator.apply import restart_requests, server_lag
from tardigrade_operator.apply.kube import (
    ChildRejected,
    ClusterWriter,
    KeysSecretTaken,
    StaleStatus,
    load_client_config,
)
from tardigrade_operator.config import OperatorConfig
from tardigrade_operator.decision import maintenance, pacing, queueing
from tardigrade_operator.decision.decide import decide
from tardigrade_operator.decision.plan import Plan
from tardigrade_operator.decision.recovery import keepers
from tardigrade_operator.observation import indexlag
from tardigrade_operator.observation.job_memory import JobState
from tardigrade_operator.observation.observe import (
    Indexes,
    Observation,
    job_keys_of,
    observe,
    parse_status,
    resource_version,
)
from tardigrade_operator.observation.observed import Observed
from tardigrade_operator.observation.pods import (
    NODE_SHUTTING_DOWN_MESSAGE,
    NodeReadiness,
    PodView,
    ServiceView,
    parse_pod,
    parse_service,
)
from tardigrade_operator.observation.progress import Progress
from tardigrade_operator.observation.reader import KubeReader
from tardigrade_operator.podhttp import pod_session
from tardigrade_operator.rendering import keys, slice_placement

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
    memo.reader = KubeReader(memo.writer, memo.session, config.progress_timeout_seconds)
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
    return {name: str(labels[slice_placement.NODE_POOL_LABEL])}


def node_kubelet(name: str, status: kopf.Status, **_: Any) -> dict[str, str]:
    """Its kubelet's version, "" where the Node shows the kubelet ignores restart rules
    (`keepers.rules_kubelet_version`)."""
    return {name: keepers.rules_kubelet_version(status)}


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
    pool = labels.get(slice_placement.NODE_POOL_LABEL)
    if pool and node_pool is not None and (before or (None, None))[1] != scheduled:
        nodes |= {node for node, store in node_pool.items() if pool in store}
    for key, pods in gang_pods.items():
        if any(pod.node_name in nodes for pod in pods):
            _wake(memo, key)


if os.environ.get("TARDIGRADE_WATCH_NODES", "true").lower() != "false":
    kopf.index("nodes", id="node_readiness")(node_readiness)
    # Where a TPU slice's leader landed: its followers are pinned to that pool.
    kopf.index("nodes", id="node_pool",
               labels={slice_placement.NODE_POOL_LABEL: kopf.PRESENT})(node_pool)
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
    echo = state is not None and state.echoes_our_write(resource_version(meta))
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
    indexes = Indexes(
        pods=gang_pods, services=gang_services, policies=kwargs.get("gang_policies"),
        nodes=kwargs.get("node_readiness"), maintenance=kwargs.get("node_maintenance"),
        pools=kwargs.get("node_pool"), kubelets=kwargs.get("node_kubelet"),
        workloads=kwargs.get("job_workloads"), flavors=kwargs.get("resource_flavors"))
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
            sleep = await reconcile(key, uid, body, memo, indexes, state, began)
            failures = 0
        except Exception as err:
            # Never crash-loop on one object: log, and a later pass retries from scratch.
            failures += 1
            lag = server_lag.explain(err)
            if lag is not None:
                logger.warning("reconcile of %s/%s refused: %s; retrying", namespace, name, lag)
            else:
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
                    indexes: Indexes, state: JobState, clock: float) -> float:
    """One pass: observe, decide, apply. Returns the seconds the loop may sleep unless woken
    (pacing.py). `clock` is the loop's monotonic time at the start of the pass."""
    seen = await observe(key, uid, body, indexes, state, memo.config, memo.reader, clock)
    if seen is None:
        # Our own creates, not yet in the index: their events wake the job.
        return memo.config.pacing_settings().busy_seconds
    plan = decide(seen.observed)
    return await _apply(key, body, memo, seen, plan, state, clock)


async def _apply(key: JobKey, body: kopf.Body, memo: kopf.Memo, seen: Observation, plan: Plan,
                 state: JobState, clock: float) -> float:
    """Carry out the plan: the status first, then the children (kube.py), the Workload, the
    events and the metrics; note what the next passes must remember."""
    namespace, name = key
    observed = seen.observed
    uid, status = observed.job.uid, observed.status
    mine = observed.gang.pods
    job_keys = seen.job_keys
    plan.patch_pods = state.in_place.unsent(plan.patch_pods, plan.status.attempt,
                                            {p.name for p in mine})
    if plan.restart_in_place:
        # A recovery is rare, and a stale key would have the kept ranks recreated: read anew.
        state.keys = None
        _, job_keys = await job_keys_of(key, uid, state, memo.reader, clock)
    try:
        written = await asyncio.to_thread(
            memo.writer.apply, namespace, name, status, plan, seen.version,
            restart_requests.sender(memo.session, plan, state.in_place, state.wake,
                                    job_keys.restart_key if job_keys else None))
    except StaleStatus:
        # Decide again at once, on the job as the API server has it now.
        fresh = await asyncio.to_thread(memo.writer.read_job, namespace, name)
        state.written = (resource_version(fresh.get("metadata") or {}),
                         parse_status(key, fresh.get("status") or {}))
        state.wake.set()
        return 0.0
    except ChildRejected as err:
        # Retrying the same spec would be refused again (and hammer the API server); the next
        # pass records the refusal in status and stops there.
        logging.getLogger(__name__).warning("%s/%s: %s", namespace, name, err)
        state.rejected = (observed.generation, str(err))
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
    state.in_place.sent(plan.patch_pods, plan.status.attempt)
    if plan.create_pods:
        # The grace counts from the last answer, not from the pass's start: at a thousand
        # ranks a pass's writes alone can take longer than the grace.
        state.created = indexlag.created(plan.create_pods, asyncio.get_running_loop().time())
    for event in plan.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    if observed.queue is not None:
        await _write_workload(key, uid, body.get("metadata") or {}, observed.spec, plan,
                              observed.queue, seen.workload, mine, memo)
    if seen.strays:
        await _drop_strays(namespace, seen.strays, mine, observed.queue is not None, memo)
    metrics.record_transition(key, status, plan.status)
    return _next_pass(observed, plan, state, seen.polled, clock, memo)


async def _drop_strays(namespace: str, strays: tuple[queueing.WorkloadView, ...],
                       pods: list[PodView], held: bool, memo: kopf.Memo) -> None:
    """The Workloads of a job that left Kueue (queueing.stray_workload_actions): `pods` as
    this pass observed them, so a pod this pass deletes still counts as active."""
    for action in queueing.stray_workload_actions(strays, any(p.active for p in pods), held):
        await asyncio.to_thread(memo.writer.apply_workload, namespace, action)


async def _write_workload(key: JobKey, uid: str, meta: Any, spec: TrainingJobSpec | None,
                          plan: Plan, gate: queueing.QueueGate,
                          workload: tuple[queueing.WorkloadView, list[dict[str, Any]]] | None,
                          pods: list[PodView], memo: kopf.Memo) -> None:
    """Carry out the Workload writes this pass's outcome asks for (queueing.workload_actions)."""
    namespace, name = key
    priority = None
    priority_class = (meta.get("labels") or {}).get(queueing.PRIORITY_LABEL)
    # Looked up to make the Workload, and again only when the label names another class than
    # the Workload's (a class's value edited later is not followed, as in Kueue).
    named = workload[0].priority[0] if workload and workload[0].priority else None
    if priority_class and (workload is None or named != priority_class):
        value = await asyncio.to_thread(memo.writer.priority_value, priority_class)
        priority = None if value is None else (priority_class, value)
    actions = queueing.workload_actions(
        queueing.JobIdentity(name, namespace, uid), spec, plan.status, gate,
        any(p.active for p in pods), priority, datetime.now(UTC),
        workload[1] if workload else ())
    for action in actions:
        await asyncio.to_thread(memo.writer.apply_workload, namespace, action)


def _next_pass(observed: Observed, plan: Plan, state: JobState, polled: Progress | None,
               clock: float, memo: kopf.Memo) -> float:
    settings = memo.config.pacing_settings()
    busy = not pacing.settled(observed, plan)
    if polled is not None:
        news = pacing.report_news(polled.report, polled.malformed)
        state.progress = state.progress.after_read(clock, news, busy, settings, random.random())
    deadline = pacing.next_deadline(
        observed, plan, timedelta(seconds=memo.config.grow_back_after_seconds))
    deadline_in = (deadline - observed.now).total_seconds() if deadline is not None else None
    return pacing.seconds_to_next_pass(clock, state.progress, busy, deadline_in, settings,
                                       again=pacing.decided_anew(observed, plan))


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
