"""kubectl on built-in kinds: typed create commands (protobuf bodies), RBAC, logs, helm."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import threading
from pathlib import Path

import pytest
import yaml
from aiohttp import web
from api_helpers import (
    Kubectl,
    api,  # noqa: F401  (fixture)
    find_kubectls,
    kubectl_ids,
    require_kubectls,
)

_ns_counter = itertools.count()


@pytest.fixture(params=find_kubectls() or [None], ids=kubectl_ids())
def kubectl(request, api):  # noqa: F811
    require_kubectls()
    return Kubectl(request.param, api.kubeconfig)


@pytest.fixture
def ns(kubectl):
    name = f"b{next(_ns_counter)}-{'old' if kubectl.old else 'new'}"
    kubectl("create", "namespace", name)
    return name


def test_typed_create_commands(kubectl, ns):
    kubectl("create", "configmap", "cm", "-n", ns, "--from-literal=a=b")
    kubectl("create", "secret", "generic", "s", "-n", ns, "--from-literal=a=b")
    kubectl("create", "serviceaccount", "sa", "-n", ns)
    kubectl("create", "deployment", "d", "-n", ns, "--image=busybox:1")
    assert kubectl.get_json("cm", "cm", "-n", ns)["data"] == {"a": "b"}
    assert kubectl.get_json("secret", "s", "-n", ns)["data"] == {"a": "Yg=="}
    dep = kubectl.get_json("deployment", "d", "-n", ns)
    assert dep["spec"]["selector"] == {"matchLabels": {"app": "d"}}
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "busybox:1"
    out = kubectl("get", "deploy", "-n", ns)
    assert out.split()[:5] == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"]


def test_rbac_manifests_apply(kubectl, ns):
    docs = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "op", "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": f"op-{ns}"},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": f"op-{ns}"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": f"op-{ns}"},
         "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": ns}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "r", "namespace": ns}, "rules": []},
        {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
         "metadata": {"name": "l", "namespace": ns}, "spec": {"holderIdentity": "me"}},
    ]
    out = kubectl.apply(*docs)
    assert out.count("created") == len(docs)
    out = kubectl.apply(*docs)
    assert out.count("unchanged") == len(docs)


def test_pods_table_and_node_table(kubectl, ns):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": ns},
           "spec": {"containers": [{"name": "c", "image": "local/python"}]}}
    kubectl.apply(pod)
    header, row = kubectl("get", "pods", "-n", ns).splitlines()
    assert header.split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert row.split()[:4] == ["p", "0/1", "Pending", "0"]
    wide = kubectl("get", "pods", "-n", ns, "-o", "wide").splitlines()[0]
    assert "NODE" in wide and "IP" in wide
    node = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": f"table-{ns}", "labels": {"node-role.kubernetes.io/worker": ""}}}
    kubectl.apply(node)
    header, row = kubectl("get", "node", f"table-{ns}").splitlines()
    assert header.split() == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    assert row.split()[:3] == [f"table-{ns}", "Unknown", "worker"]


class FakeKubelet:
    """Serves /containerLogs like a kubelet, so the API server's log proxy can be tested."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = 0

    def start(self) -> FakeKubelet:
        async def logs(request: web.Request) -> web.Response:
            m = request.match_info
            lines = [f"line {i} of {m['pod']}/{m['container']}" for i in range(5)]
            tail = request.query.get("tailLines")
            if tail:
                lines = lines[-int(tail):]
            return web.Response(text="\n".join(lines) + "\n")

        async def run() -> None:
            app = web.Application()
            app.router.add_get("/containerLogs/{ns}/{pod}/{container}", logs)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(run(), self.loop).result(5)
        return self


def test_logs_are_proxied_to_the_nodes_kubelet(kubectl, ns):
    kubelet = FakeKubelet().start()
    node = f"logs-node-{ns}"
    kubectl.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    from urllib.request import Request, urlopen

    cfg = yaml.safe_load(Path(kubectl.env["KUBECONFIG"]).read_text())
    url = cfg["clusters"][0]["cluster"]["server"]
    status = {"status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                         "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet.port}}}}
    import json

    req = Request(f"{url}/api/v1/nodes/{node}/status", data=json.dumps(status).encode(),
                  method="PATCH", headers={"Content-Type": "application/merge-patch+json"})
    with urlopen(req) as resp:
        assert resp.status == 200
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "talker", "namespace": ns},
           "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]}}
    kubectl.apply(pod)
    assert kubectl("logs", "talker", "-n", ns).splitlines() == [
        f"line {i} of talker/c" for i in range(5)]
    assert kubectl("logs", "talker", "-n", ns, "--tail=2").splitlines() == [
        "line 3 of talker/c", "line 4 of talker/c"]
    err = kubectl.fails("logs", "talker", "-n", ns, "-c", "nope")
    assert "container nope is not valid for pod talker" in err


def test_helm_template_then_kubectl_apply(kubectl, ns, tmp_path):
    helm = kubectl.binary.parent / "helm"
    if kubectl.old or not helm.exists():
        if os.environ.get("CI") == "true" and not kubectl.old:
            pytest.fail("helm is missing: run .ci/install-kube-clients.sh")
        pytest.skip("helm runs with the current kubectl only")
    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: demo\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("replicas: 2\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cfg\n"
        "data:\n  replicas: \"{{ .Values.replicas }}\"\n")
    rendered = subprocess.run([str(helm), "template", "rel", str(chart)], capture_output=True,
                              text=True, check=True, env=kubectl.env).stdout
    kubectl("apply", "-n", ns, "-f", "-", input=rendered)
    assert kubectl.get_json("cm", "rel-cfg", "-n", ns)["data"] == {"replicas": "2"}


def test_openapi_documents_serve_kubectl_explain_and_validation(kubectl):
    if kubectl.old:
        out = kubectl("get", "--raw", "/openapi/v2")
        assert '"swagger":"2.0"' in out.replace(" ", "")
        return
    root = yaml.safe_load(kubectl("get", "--raw", "/openapi/v3"))
    assert "api/v1" in root["paths"] and "apis/apps/v1" in root["paths"]



def test_unknown_fields_of_builtin_kinds(kubectl, ns):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "typo", "namespace": ns},
           "spec": {"containers": [{"name": "c", "image": "x", "imagee": "y"}]}}
    if kubectl.old:
        # kubectl 1.20 validates client side first; without it the server drops the field.
        done = kubectl.run("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(pod))
        assert 'unknown field "spec.containers[0].imagee"' in done.stderr
        got = kubectl.get_json("pod", "typo", "-n", ns)
        assert "imagee" not in got["spec"]["containers"][0]
    else:
        err = kubectl.fails("apply", "-f", "-", input=yaml.safe_dump(pod))
        assert ('Pod in version "v1" cannot be handled as a Pod: strict decoding error: unknown '
                'field "spec.containers[0].imagee"') in err


def test_replace_with_the_original_manifest(kubectl, ns):
    # Regression: defaults were applied on create only, so replacing a pod with the manifest
    # it was created from looked like a forbidden spec change.
    docs = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "rp", "namespace": ns},
             "spec": {"containers": [{"name": "c", "image": "busybox:1"}]}},
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "rs", "namespace": ns},
             "spec": {"ports": [{"port": 80}]}}]
    text = yaml.safe_dump_all(docs)
    kubectl("create", "-f", "-", input=text)
    ip = kubectl.get_json("svc", "rs", "-n", ns)["spec"]["clusterIP"]
    kubectl("replace", "-f", "-", input=text)
    assert kubectl.get_json("svc", "rs", "-n", ns)["spec"]["clusterIP"] == ip
    changed = text.replace("busybox:1", "busybox:2")
    kubectl("replace", "-f", "-", input=changed)
    assert kubectl.get_json("pod", "rp", "-n", ns)["spec"]["containers"][0]["image"] == (
        "busybox:2")
    err = kubectl.fails("replace", "-f", "-", input=changed.replace("name: c", "name: d"))
    assert "pod updates may not change fields other than" in err
