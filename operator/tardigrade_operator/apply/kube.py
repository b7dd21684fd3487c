"""The only place that writes to the cluster: carry out a Plan, idempotently."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from tardigrade_operator import apidecode, finalizers, naming
from tardigrade_operator.api import types
from tardigrade_operator.api.types import TrainingJobStatus
from tardigrade_operator.apply import tokenreview_access
from tardigrade_operator.decision import queueing
from tardigrade_operator.decision.plan import Plan
from tardigrade_operator.observation import autoscaling

log = logging.getLogger(__name__)


def load_client_config() -> None:
    """In a pod: the service account; elsewhere: KUBECONFIG, like kubectl."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    config = kubernetes.client.Configuration.get_default_copy()
    # The writer patches PATCH_CONCURRENCY pods at a time; urllib3's pool (5 connections per
    # CPU by default) would drop the connections beyond it and open new TLS ones.
    config.connection_pool_maxsize = max(config.connection_pool_maxsize or 0,
                                         PATCH_CONCURRENCY + 4)
    kubernetes.client.Configuration.set_default(config)
    apidecode.use_bounded_client()


class ChildRejected(Exception):
    """The API server refused a pod or service we rendered (400/413/422): the spec produces an
    object Kubernetes will never accept, so retrying cannot help."""

    def __init__(self, kind: str, name: str, message: str) -> None:
        super().__init__(f"the API server rejected {kind} {name}: {message}")
        self.kind, self.name, self.message = kind, name, message


# 400 BadRequest, 413 RequestEntityTooLarge, 422 Invalid: permanent for this spec. 403 is not
# here: quota and RBAC can change without the spec changing.
_PERMANENT_CREATE_ERRORS = (400, 413, 422)


class KeysSecretTaken(Exception):
    """Creating the job's keys Secret answered AlreadyExists, and the one there is not the
    job's: its pods must not be created to read it (the next pass holds the job, decide.py)."""


class StaleStatus(Exception):
    """The job changed after the status the plan was decided on: decide again, freshly read."""


# Concurrent pod patches (the kept pods' labels after a restart in place).
PATCH_CONCURRENCY = 16
# Kueue installed after the operator started is noticed within this long.
KUEUE_DISCOVERY_SECONDS = 30.0


class ClusterWriter:
    """Applies plans in a fixed order: status first (it records what is about to happen),
    then finalizer releases, deletions and creations. Every step tolerates being repeated."""

    # Cluster-wide installs: the ClusterRoleBinding that gives the trainers' accounts
    # TokenReview, which the operator fills in before a job's pods (tokenreview_access.py).
    token_review_binding: str | None = None

    def __init__(self, api_client: kubernetes.client.ApiClient | None = None,
                 token_review_binding: str | None = None) -> None:
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.networking = kubernetes.client.NetworkingV1Api(api_client)
        self.rbac = kubernetes.client.RbacAuthorizationV1Api(api_client)
        self.token_review_binding = token_review_binding
        self.apis = kubernetes.client.ApisApi(api_client)
        # (when it was asked, what discovery said of Kueue)
        self._kueue_api: tuple[float, queueing.KueueApi] | None = None

    def apply(self, namespace: str, name: str, old_status: TrainingJobStatus,
              plan: Plan, resource_version: str | None = None,
              ask_ranks: Callable[[], None] | None = None) -> str | None:
        """Carry out the plan; returns the job's resourceVersion after a status write.
        `ask_ranks` sends the plan's restart-in-place requests (handlers.py).

        With `resource_version` (that of the status the plan was decided on) the status write
        is conditional: a plan decided on a stale status (our previous write went through
        but its answer was lost, and the watch has not caught up) would count the same
        disruption twice; the API server refuses it instead and `StaleStatus` is raised.
        """
        written = None
        new = status_json(plan.status)
        old = status_json(old_status)
        if new != old:
            body: dict[str, Any] = {"status": merge_patch(old, new)}
            if resource_version:
                body["metadata"] = {"resourceVersion": resource_version}
            try:
                job = _raw(self.custom.patch_namespaced_custom_object_status,
                           types.GROUP, types.VERSION, namespace, types.PLURAL, name, body)
            except ApiException as err:
                if err.status == 409:
                    raise StaleStatus(f"{namespace}/{name} changed since resourceVersion "
                                      f"{resource_version}") from None
                raise
            written = str(job["metadata"]["resourceVersion"])
        for pod_name in plan.release_pods:
            self.release_pod(namespace, pod_name)
        for pod_name, grace in plan.delete_pods:
            self.delete_pod(namespace, pod_name, grace)
        # The kept ranks learn their new world from the request itself (recovery/in_place.py),
        # and each waits for its own only seconds after the gang's save: it goes before the
        # creations.
        if ask_ranks is not None:
            ask_ranks()
        if plan.create_keys_secret is not None:
            self._create_keys_secret(namespace, plan.create_keys_secret)
        if plan.create_service is not None:
            self._create(self.core.create_namespaced_service, namespace, plan.create_service)
        if plan.create_network_policy is not None:
            self._create(self.networking.create_namespaced_network_policy, namespace,
                         plan.create_network_policy)
        if plan.create_pods and self.token_review_binding:
            # Before the pods: rank 0 reviews its peers' tokens as soon as it starts.
            self.grant_token_review(namespace, plan.create_pods[0]["spec"].get(
                "serviceAccountName") or "default")
        for pod in plan.create_pods:
            self._create(self.core.create_namespaced_pod, namespace, pod)
        # Last (a plan with patches is a later pass's, once the gang runs again: the kept
        # pods' label and world annotation, in_place.late_labels), together rather
        # than one round trip after another.
        if plan.patch_pods:
            with ThreadPoolExecutor(min(PATCH_CONCURRENCY, len(plan.patch_pods))) as pool:
                list(pool.map(lambda item: self.patch_pod(namespace, *item), plan.patch_pods))
        return written

    def grant_token_review(self, namespace: str, account: str) -> bool:
        """Add the account to the trainers' TokenReview binding unless it is there."""
        name = self.token_review_binding
        assert name is not None
        return tokenreview_access.ensure(
            lambda: _raw(self.rbac.read_cluster_role_binding, name),
            lambda body: _raw(self.rbac.replace_cluster_role_binding, name, body),
            namespace, account)

    def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        try:
            _raw(self.core.patch_namespaced_pod, name, namespace, patch)
        except ApiException as err:
            if err.status != 404:  # gone meanwhile: the next pass recreates its rank
                raise

    def delete_pod(self, namespace: str, name: str, grace: int | None) -> None:
        body = kubernetes.client.V1DeleteOptions(grace_period_seconds=grace)
        try:
            _raw(self.core.delete_namespaced_pod, name, namespace, body=body)
        except ApiException as err:
            if err.status != 404:
                raise

    def release_pod(self, namespace: str, name: str) -> None:
        """Drop our finalizer with a guarded JSON patch (other finalizers stay untouched)."""
        try:
            pod = self.core.read_namespaced_pod(name, namespace)
        except ApiException as err:
            if err.status == 404:
                return
            raise
        finalizers = list(pod.metadata.finalizers or [])
        if naming.POD_FINALIZER not in finalizers:
            return
        index = finalizers.index(naming.POD_FINALIZER)
        patch = [
            {"op": "test", "path": f"/metadata/finalizers/{index}", "value": naming.POD_FINALIZER},
            {"op": "remove", "path": f"/metadata/finalizers/{index}"},
        ]
        try:
            self.core.patch_namespaced_pod(name, namespace, patch)
        except ApiException as err:
            # 404: gone already; 422: the list changed under us, the next pass retries.
            if err.status not in (404, 422):
                raise

    def _create_keys_secret(self, namespace: str, manifest: dict[str, Any]) -> None:
        """Create the job's keys Secret; one of that name made meanwhile by someone else (its
        create won the race the pass's read could not see) stops the pass before any pod."""
        try:
            _raw(self.core.create_namespaced_secret, namespace, manifest)
            return
        except ApiException as err:
            name = manifest["metadata"]["name"]
            if err.status in _PERMANENT_CREATE_ERRORS:
                raise ChildRejected("Secret", name, _api_message(err)) from err
            if err.status != 409:
                raise
        found = self.read_secret(namespace, name)
        uid = manifest["metadata"]["ownerReferences"][0]["uid"]
        if found is None or finalizers.owner_uid(found) != uid:
            raise KeysSecretTaken(f"Secret {namespace}/{name} exists and is not the job's")

    def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Secret of that name as plain JSON, or None. A get by name: the operator has no
        list or watch on Secrets, which would hand it every Secret of the namespace."""
        try:
            return dict(_raw(self.core.read_namespaced_secret, name, namespace))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def read_job(self, namespace: str, name: str) -> dict[str, Any]:
        return dict(self.custom.get_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, name))

    def read_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Service of that name as plain JSON, or None. A list by name, not a get: the
        operator is granted list (and watch) on Services, which is all its index needs."""
        found = self.core.list_namespaced_service(
            namespace, field_selector=f"metadata.name={name}").items
        if not found:
            return None
        return dict(self.core.api_client.sanitize_for_serialization(found[0]))

    def list_job_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        """The job's pods straight from the API server, as plain JSON dicts."""
        listed = _raw(self.core.list_namespaced_pod, namespace,
                      label_selector=naming.job_selector(job))
        return list(listed.get("items") or [])

    def list_scale_up_events(self, namespace: str) -> list[dict[str, Any]]:
        """The node autoscaler's Events on pods in the namespace (autoscaling.SCALE_UP_REASONS):
        one list per reason, since a field selector cannot say "one of"."""
        events: list[dict[str, Any]] = []
        for reason in sorted(autoscaling.SCALE_UP_REASONS):
            listed = self.core.list_namespaced_event(
                namespace, field_selector=f"involvedObject.kind=Pod,reason={reason}")
            events += [self.core.api_client.sanitize_for_serialization(e) for e in listed.items]
        return events

    def release_all(self, namespace: str, job: str, uid: str) -> None:
        """Release every pod of the job with this uid (a new job of the same name keeps its)."""
        for pod in self.list_job_pods(namespace, job):
            if finalizers.owner_uid(pod) == uid:
                self.release_pod(namespace, pod["metadata"]["name"])

    def release_orphan(self, namespace: str, pod: Mapping[str, Any]) -> None:
        """Release a pod whose job looks gone, once the API server confirms it: no job of that
        name, another job of that name, or the job being deleted."""
        job = pod["metadata"]["labels"][naming.LABEL_JOB]
        try:
            found = self.read_job(namespace, job)
        except ApiException as err:
            if err.status != 404:
                raise
            found = None
        meta = (found or {}).get("metadata") or {}
        if meta.get("uid") == finalizers.owner_uid(pod) and not meta.get("deletionTimestamp"):
            return
        log.info("releasing %s/%s: its TrainingJob is gone", namespace, pod["metadata"]["name"])
        self.release_pod(namespace, pod["metadata"]["name"])

    @staticmethod
    def _create(create: Any, namespace: str, manifest: dict[str, Any]) -> None:
        try:
            _raw(create, namespace, manifest)
        except ApiException as err:
            name = manifest["metadata"]["name"]
            if err.status in _PERMANENT_CREATE_ERRORS:
                raise ChildRejected(manifest["kind"], name, _api_message(err)) from err
            if err.status != 409:  # AlreadyExists: an earlier pass created it
                raise
            log.debug("%s already exists", name)


    # --- Kueue (queueing.py): the job side of the Workload protocol ---------------------
    def kueue_api(self) -> queueing.KueueApi:
        """What the API server serves of Kueue (queueing.KueueApi), from discovery, asked
        again at most every KUEUE_DISCOVERY_SECONDS."""
        now = time.monotonic()
        if self._kueue_api is not None and now - self._kueue_api[0] < KUEUE_DISCOVERY_SECONDS:
            return self._kueue_api[1]
        try:
            listed = self.custom.get_api_resources(queueing.GROUP, queueing.VERSION)
            served = any(r.name == queueing.WORKLOADS for r in listed.resources or [])
        except ApiException as err:
            if err.status != 404:
                raise
            served = False
        versions: tuple[str, ...] = ()
        if not served:
            # Which Kueue, if any: an older one serves its group at other versions only.
            groups = self.apis.get_api_versions().groups or []
            versions = tuple(v.version for g in groups if g.name == queueing.GROUP
                             for v in g.versions or [])
        api = queueing.KueueApi(served, versions)
        self._kueue_api = (now, api)
        return api

    def priority_value(self, name: str) -> int | None:
        """A WorkloadPriorityClass's value; None if it does not exist."""
        try:
            found = self.custom.get_cluster_custom_object(
                queueing.GROUP, queueing.VERSION, queueing.PRIORITY_CLASSES, name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return int(found.get("value") or 0)

    def apply_workload(self, namespace: str, action: queueing.WorkloadAction) -> None:
        """One Workload write. A conflict (Kueue wrote meanwhile) is left to the next pass,
        which the Workload's own change wakes."""
        args = (queueing.GROUP, queueing.VERSION, namespace, queueing.WORKLOADS)
        try:
            if isinstance(action, queueing.CreateWorkload):
                self.custom.create_namespaced_custom_object(*args, action.body)
                return
            if isinstance(action, queueing.DeleteWorkload):
                self.custom.delete_namespaced_custom_object(
                    *args, action.name, body={"preconditions": {
                        "resourceVersion": action.resource_version}})
                return
            current = self.custom.get_namespaced_custom_object(*args, action.name)
            if current["metadata"]["resourceVersion"] != action.resource_version:
                return  # decided on an older Workload: the next pass decides again
            if isinstance(action, queueing.PatchWorkloadSpec):
                spec = current["spec"]
                for field, value in action.changes.items():
                    if value is None:
                        spec.pop(field, None)
                    else:
                        spec[field] = value
                annotations = current["metadata"].setdefault("annotations", {})
                for key, mark in action.annotations.items():
                    if mark is None:
                        annotations.pop(key, None)
                    else:
                        annotations[key] = mark
                self.custom.replace_namespaced_custom_object(*args, action.name, current)
                return
            if isinstance(action, queueing.ResizeWorkload):
                if action.clear_reclaimable:
                    current["status"] = {k: v for k, v in (current.get("status") or {}).items()
                                         if k != "reclaimablePods"}
                    current = self.custom.replace_namespaced_custom_object_status(
                        *args, action.name, current)
                podset = current["spec"]["podSets"][0]
                podset["count"] = action.count
                if action.template is not None and action.podset_hash is not None:
                    podset["template"] = action.template
                    if action.topology is None:
                        podset.pop("topologyRequest", None)
                    else:
                        podset["topologyRequest"] = action.topology
                    annotations = current["metadata"].setdefault("annotations", {})
                    annotations[queueing.PODSET_HASH_ANNOTATION] = action.podset_hash
                if action.min_count is None:
                    podset.pop("minCount", None)
                else:
                    podset["minCount"] = action.min_count
                self.custom.replace_namespaced_custom_object(*args, action.name, current)
                return
            status = dict(current.get("status") or {})
            if isinstance(action, queueing.ReclaimPods):
                status["reclaimablePods"] = [{"name": queueing.PODSET, "count": action.count}]
                current["status"] = status
                self.custom.replace_namespaced_custom_object_status(*args, action.name, current)
                return
            status["conditions"] = action.conditions
            if isinstance(action, queueing.ReleaseQuota):
                status.pop("admission", None)
            current["status"] = status
            self.custom.replace_namespaced_custom_object_status(*args, action.name, current)
        except ApiException as err:
            if err.status in (404, 409):
                return
            raise


def _raw(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A client call's answer as plain JSON. The client's own models cost more CPU than the
    request: at a thousand pods, deserializing a pod list or the answers of a gang's patches
    takes seconds of the operator's one core, for objects it reads as dicts or not at all.
    Errors still raise ApiException (the client checks the status first)."""
    answer = call(*args, _preload_content=False, **kwargs)
    try:
        data = answer.data
    finally:
        answer.release_conn()
    return apidecode.loads(data) if data else None


def _api_message(err: ApiException) -> str:
    """The Status message the API server sent, else the HTTP reason."""
    try:
        return str(apidecode.loads(err.body or "{}").get("message") or err.reason)
    except (ValueError, AttributeError):
        return str(err.reason)


def status_json(status: TrainingJobStatus) -> dict[str, Any]:
    return status.model_dump(by_alias=True, exclude_none=True, mode="json")


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386) from `old` to `new`: a field `new` no longer has is
    sent as null, which removes it; without that, a status field that went back to unset
    (say `queue.growingTo` once the grow is done) would stay stored as it was."""
    patch = dict(new)
    for key, value in old.items():
        if key not in new:
            patch[key] = None
        elif isinstance(value, Mapping) and isinstance(new[key], Mapping):
            patch[key] = merge_patch(value, new[key])
    return patch
