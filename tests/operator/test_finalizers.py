"""Which pods still need the gang-tracking finalizer, and releasing the ones that do not."""

from __future__ import annotations

import kubernetes
import pytest
import yaml
from tardigrade_operator import finalizers, naming
from tardigrade_operator.kube import ClusterWriter
from tardigrade_operator.render import JobRef

from tests.conftest import CRD_FILE, EXAMPLES
from tests.local.api_helpers import running_server

JOB = "tiny-gpt"


def pod(name: str, owner_uid: str | None, tracked: bool = True) -> dict:
    meta: dict = {"name": name, "namespace": "default",
                  "labels": naming.pod_labels(JOB, 1, 0)}
    if owner_uid is not None:
        meta["ownerReferences"] = [JobRef(name=JOB, namespace="default",
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
def cluster(tmp_path):
    with running_server(tmp_path, crd_paths=[CRD_FILE]) as (_, kubeconfig):
        client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        job = yaml.safe_load((EXAMPLES / "trainingjob.yaml").read_text())
        created = kubernetes.client.CustomObjectsApi(client).create_namespaced_custom_object(
            "tardigrade.dev", "v1alpha1", "default", "trainingjobs", job)
        yield ClusterWriter(client), created["metadata"]["uid"]


def _finalizers(writer: ClusterWriter, name: str) -> list[str] | None:
    """The pod's finalizers; None once it is gone (the garbage collector deletes a pod whose
    owner does not exist as soon as nothing holds it)."""
    try:
        found = writer.core.read_namespaced_pod(name, "default")
    except kubernetes.client.exceptions.ApiException as err:
        if err.status == 404:
            return None
        raise
    return list(found.metadata.finalizers or [])


def test_release_orphan_asks_the_api_server_first(cluster):
    writer, uid = cluster
    writer.core.create_namespaced_pod("default", pod("mine", uid))
    writer.core.create_namespaced_pod("default", pod("stale", "uid-of-an-older-job"))
    for name in ("mine", "stale"):
        body = writer.core.api_client.sanitize_for_serialization(
            writer.core.read_namespaced_pod(name, "default"))
        writer.release_orphan("default", body)
    # The live job owns "mine": an index that lagged must not release it.
    assert _finalizers(writer, "mine") == [naming.POD_FINALIZER]
    assert _finalizers(writer, "stale") is None


def test_release_all_keeps_pods_of_a_new_job_of_the_same_name(cluster):
    writer, uid = cluster
    writer.core.create_namespaced_pod("default", pod("old", "uid-of-the-deleted-job"))
    writer.core.create_namespaced_pod("default", pod("new", uid))
    writer.release_all("default", JOB, "uid-of-the-deleted-job")
    assert _finalizers(writer, "old") is None
    assert _finalizers(writer, "new") == [naming.POD_FINALIZER]


def test_no_handler_puts_a_finalizer_on_trainingjobs():
    """kopf adds its finalizer to an object when a daemon, timer or mandatory on-delete handler
    matches it; none may, or `kubectl delete tj` hangs whenever no operator runs."""
    import kopf
    import tardigrade_operator.handlers  # noqa: F401  (registers the handlers)

    registry = kopf.get_default_registry()
    handlers = [*registry._spawning.get_all_handlers(), *registry._changing.get_all_handlers()]
    assert any(h.id == "keep_gang" for h in handlers)
    assert [h.id for h in handlers if h.requires_finalizer] == []
