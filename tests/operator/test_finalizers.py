"""Which pods still need the gang-tracking finalizer, and releasing the ones that do not."""

from __future__ import annotations

import kubernetes
import pytest
import yaml
from tardigrade_operator import finalizers, naming
from tardigrade_operator.apply.kube import ClusterWriter
from tardigrade_operator.rendering.manifests import JobRef

from tests.conftest import EXAMPLES

JOB = "tiny-gpt"


def pod(name: str, owner_uid: str | None, tracked: bool = True,
        namespace: str = "default") -> dict:
    meta: dict = {"name": name, "namespace": namespace,
                  "labels": naming.pod_labels(JOB, 1, 0)}
    if owner_uid is not None:
        meta["ownerReferences"] = [JobRef(name=JOB, namespace=namespace,
                                          uid=owner_uid).owner_reference()]
    if tracked:
        meta["finalizers"] = [naming.POD_FINALIZER]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "trainer", "image": "python"}]}}


def test_owner_uid_reads_the_trainingjob_owner_reference():
    assert finalizers.owner_uid(pod("p", "u-1")) == "u-1"
    assert finalizers.owner_uid(pod("p", None)) is None
    other = pod("p", None)
    other["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                             "name": "x", "uid": "u-1"}]
    assert finalizers.owner_uid(other) is None


@pytest.mark.parametrize(("owner", "live", "tracked", "expected"), [
    ("u-1", ["u-1"], True, False),   # its job lives: the reconcile pass releases it
    ("u-1", [], True, True),         # job gone (or being deleted: not in the live index)
    ("u-1", ["u-2"], True, True),    # a new job of the same name
    (None, ["u-1"], True, True),     # no owner at all
    ("u-1", [], False, False),       # nothing to release
])
def test_orphaned(owner, live, tracked, expected):
    assert finalizers.orphaned(pod("p", owner, tracked), live) is expected


@pytest.fixture
def cluster(shared_api):
    namespace = shared_api.new_namespace("finalizers")
    job = yaml.safe_load((EXAMPLES / "trainingjob.yaml").read_text())
    created = kubernetes.client.CustomObjectsApi(shared_api.api).create_namespaced_custom_object(
        "tardigrade.dev", "v1alpha1", namespace, "trainingjobs", job)
    return ClusterWriter(shared_api.api), created["metadata"]["uid"], namespace


def _finalizers(writer: ClusterWriter, name: str, namespace: str) -> list[str] | None:
    """The pod's finalizers; None once it is gone (the garbage collector deletes a pod whose
    owner does not exist as soon as nothing holds it)."""
    try:
        found = writer.core.read_namespaced_pod(name, namespace)
    except kubernetes.client.exceptions.ApiException as err:
        if err.status == 404:
            return None
        raise
    return list(found.metadata.finalizers or [])


def _gone_or_unfinalized(writer: ClusterWriter, name: str, namespace: str) -> bool:
    """Released: the garbage collector deletes a pod whose owner does not exist once nothing
    holds it, so the pod may already be gone."""
    return not _finalizers(writer, name, namespace)


def test_release_orphan_asks_the_api_server_first(cluster):
    writer, uid, ns = cluster
    writer.core.create_namespaced_pod(ns, pod("mine", uid, namespace=ns))
    writer.core.create_namespaced_pod(ns, pod("stale", "uid-of-an-older-job", namespace=ns))
    for name in ("mine", "stale"):
        body = writer.core.api_client.sanitize_for_serialization(
            writer.core.read_namespaced_pod(name, ns))
        writer.release_orphan(ns, body)
    # The live job owns "mine": an index that lagged must not release it.
    assert _finalizers(writer, "mine", ns) == [naming.POD_FINALIZER]
    assert _gone_or_unfinalized(writer, "stale", ns)


def test_release_all_keeps_pods_of_a_new_job_of_the_same_name(cluster):
    writer, uid, ns = cluster
    writer.core.create_namespaced_pod(ns, pod("old", "uid-of-the-deleted-job", namespace=ns))
    writer.core.create_namespaced_pod(ns, pod("new", uid, namespace=ns))
    writer.release_all(ns, JOB, "uid-of-the-deleted-job")
    assert _gone_or_unfinalized(writer, "old", ns)
    assert _finalizers(writer, "new", ns) == [naming.POD_FINALIZER]


def test_no_handler_puts_a_finalizer_on_trainingjobs():
    """kopf adds its finalizer to an object when a daemon, timer or mandatory on-delete handler
    matches it; none may, or `kubectl delete tj` hangs whenever no operator runs."""
    import kopf
    import tardigrade_operator.handlers  # noqa: F401  (registers the handlers)

    registry = kopf.get_default_registry()
    handlers = [*registry._spawning.get_all_handlers(), *registry._changing.get_all_handlers()]
    assert any(h.id == "keep_gang" for h in handlers)
    assert [h.id for h in handlers if h.requires_finalizer] == []
