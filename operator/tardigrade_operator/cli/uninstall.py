"""Before the operator is uninstalled: stop it, then release what only it would release.

The chart runs this as a `pre-delete` hook (`tardigrade operator release`). Once the operator
is gone nobody drops the pods' `gang-tracking` finalizer, and a job deleted afterwards would
leave its pods (and their namespace) in Terminating. The operator is scaled to zero first, and
its pods waited for, so that no reconcile pass creates a tracked pod after the release; the
Deployment itself goes with the rest of the release right after.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import kubernetes
from kubernetes.client.exceptions import ApiException

from tardigrade_operator import naming
from tardigrade_operator.apply.kube import ClusterWriter

log = logging.getLogger(__name__)


def stop_deployment(apps: kubernetes.client.AppsV1Api, core: kubernetes.client.CoreV1Api,
                    namespace: str, name: str, timeout: float,
                    clock: Callable[[], float] = time.monotonic) -> None:
    """Scale the Deployment to zero and wait until none of its pods is left."""
    try:
        deployment = apps.read_namespaced_deployment(name, namespace)
    except ApiException as err:
        if err.status == 404:
            return
        raise
    apps.patch_namespaced_deployment_scale(name, namespace, {"spec": {"replicas": 0}})
    labels = deployment.spec.selector.match_labels or {}
    selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    deadline = clock() + timeout
    while True:
        left = [p.metadata.name for p in core.list_namespaced_pod(
            namespace, label_selector=selector).items if _from_replica_set(p)]
        if not left:
            return
        if clock() > deadline:
            raise TimeoutError(f"operator pods still running after {timeout:g} s: "
                               f"{', '.join(left)}")
        time.sleep(0.5)


def release_pods(writer: ClusterWriter, namespaces: Iterable[str] | None) -> list[str]:
    """Drop the tracking finalizer from every trainer pod (all namespaces when None)."""
    selector = naming.LABEL_JOB
    if namespaces is None:
        pods = writer.core.list_pod_for_all_namespaces(label_selector=selector).items
    else:
        pods = [p for ns in namespaces
                for p in writer.core.list_namespaced_pod(ns, label_selector=selector).items]
    released = []
    for pod in pods:
        if naming.POD_FINALIZER in (pod.metadata.finalizers or []):
            writer.release_pod(pod.metadata.namespace, pod.metadata.name)
            released.append(f"{pod.metadata.namespace}/{pod.metadata.name}")
    return released


def _from_replica_set(pod: kubernetes.client.V1Pod) -> bool:
    """A pod of the Deployment (through its ReplicaSets), not one that only shares labels."""
    return any(ref.kind == "ReplicaSet" and ref.controller
               for ref in pod.metadata.owner_references or [])
