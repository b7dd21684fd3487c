"""A tiny kopf operator round-trip against the local API server (kopf 1.45 as the client)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from api_helpers import api, wait_for, widget, widget_crd  # noqa: F401  (fixture)
from kubernetes import client, config
from kubernetes.client.rest import ApiException

OPERATOR = textwrap.dedent('''
    import kopf

    @kopf.on.startup()
    def configure(settings, **_):
        settings.posting.level = 0
        settings.watching.server_timeout = 10
        settings.persistence.finalizer = "example.dev/kopf"

    @kopf.on.create("example.dev", "v1", "widgets")
    def created(body, patch, **_):
        patch.status["phase"] = "Seen"
        kopf.info(body, reason="Seen", message="the operator saw it")

    @kopf.on.field("example.dev", "v1", "widgets", field="spec.replicas")
    def rescaled(new, patch, **_):
        patch.status["replicas"] = new

    @kopf.on.delete("example.dev", "v1", "widgets")
    def deleted(name, namespace, **_):
        import kubernetes
        kubernetes.config.load_kube_config()
        kubernetes.client.CoreV1Api().create_namespaced_config_map(namespace, {
            "metadata": {"name": f"deleted-{name}"}})
''')


@pytest.fixture
def operator(api, tmp_path):  # noqa: F811
    path = tmp_path / "operator.py"
    path.write_text(OPERATOR)
    env = {**os.environ, "KUBECONFIG": str(api.kubeconfig)}
    proc = subprocess.Popen([sys.executable, "-m", "kopf", "run", "--standalone",
                             "--namespace", "default", str(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield proc
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    # Anything kopf could not do against this server shows up as an API error in its log.
    assert "APIError" not in out and "Traceback" not in out, out


def test_kopf_operator_round_trip(api, operator):  # noqa: F811
    k = config.new_client_from_config(config_file=str(api.kubeconfig))
    ext = client.ApiextensionsV1Api(k)
    try:
        ext.create_custom_resource_definition(widget_crd())
    except ApiException as err:
        assert err.status == 409
    custom = client.CustomObjectsApi(k)
    core = client.CoreV1Api(k)
    args = ("example.dev", "v1", "default", "widgets")
    custom.create_namespaced_custom_object(*args, widget("kopfy", replicas=2))

    def get():
        return custom.get_namespaced_custom_object(*args, "kopfy")

    # kopf may run the create and the field handler in separate patches: wait for both.
    obj = wait_for(lambda: (lambda o: o if o.get("status", {}) == {"phase": "Seen",
                                                                   "replicas": 2} else None)(
        get()), timeout=20, what="kopf create and field handlers")
    assert "example.dev/kopf" in obj["metadata"]["finalizers"]
    assert "kopf.zalando.org/last-handled-configuration" in obj["metadata"]["annotations"]
    custom.patch_namespaced_custom_object(*args, "kopfy", {"spec": {"replicas": 3}})
    wait_for(lambda: get().get("status", {}).get("replicas") == 3, timeout=20,
             what="kopf field handler")
    custom.delete_namespaced_custom_object(*args, "kopfy")

    def gone():
        try:
            get()
        except ApiException as err:
            return err.status == 404
        return False

    wait_for(gone, timeout=20, what="kopf to remove its finalizer")
    assert core.read_namespaced_config_map("deleted-kopfy", "default")
    wait_for(lambda: [e for e in core.list_namespaced_event("default").items
                      if e.involved_object.name == "kopfy" and e.reason == "Seen"],
             timeout=20, what="kopf's events")
