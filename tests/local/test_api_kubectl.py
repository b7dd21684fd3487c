"""Conformance: the real kubectl binaries (current and 1.20) against the local API server."""

from __future__ import annotations

import itertools
import json
import subprocess

import pytest
import yaml
from api_helpers import (
    Kubectl,
    api,  # noqa: F401  (fixture)
    find_kubectls,
    kubectl_ids,
    require_kubectls,
    wait_for,
    widget,
    widget_crd,
)

_ns_counter = itertools.count()


@pytest.fixture(params=find_kubectls() or [None], ids=kubectl_ids())
def kubectl(request, api):  # noqa: F811
    require_kubectls()
    k = Kubectl(request.param, api.kubeconfig)
    k.apply(widget_crd())
    return k


@pytest.fixture
def ns(kubectl):
    name = f"t{next(_ns_counter)}-{'old' if kubectl.old else 'new'}"
    kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


def test_version_and_discovery(kubectl):
    out = kubectl("api-resources")
    assert "widgets" in out and "wg" in out and "example.dev/v1" in out
    assert "deployments" in out and "leases" in out
    assert kubectl("api-versions").count("example.dev/v1") == 1


def test_apply_get_with_printer_columns(kubectl, ns):
    kubectl.apply(widget("w1", ns, replicas=2))
    kubectl("patch", "wg", "w1", "-n", ns, "--subresource=status", "--type=merge", "-p",
            json.dumps({"status": {"phase": "Running",
                                   "conditions": [{"type": "Ready", "status": "True"}]}})
            ) if not kubectl.old else None
    out = kubectl("get", "wg", "-n", ns)
    header, row = out.splitlines()[:2]
    assert header.split() == ["NAME", "REPLICAS", "PHASE", "READY", "AGE"]
    cells = row.split()
    assert cells[:2] == ["w1", "2"]
    if not kubectl.old:
        assert cells[2:4] == ["Running", "True"]
    # apply again: unchanged, then changed through a merge patch
    assert "unchanged" in kubectl.apply(widget("w1", ns, replicas=2))
    assert "configured" in kubectl.apply(widget("w1", ns, replicas=3))
    assert kubectl("get", "widget", "w1", "-n", ns, "-o", "jsonpath={.spec.replicas}") == "3"
    obj = yaml.safe_load(kubectl("get", "widgets.example.dev/w1", "-n", ns, "-o", "yaml"))
    assert obj["spec"]["policy"] == "Always"  # defaulted by the schema
    assert obj["metadata"]["generation"] == 2
    assert "managedFields" not in obj["metadata"]


def test_server_side_apply(kubectl, ns):
    if kubectl.old:
        pytest.skip("kubectl 1.20's --server-side is the same request; covered by current")
    out = kubectl.apply(widget("ssa", ns, replicas=2), server_side=True)
    assert "serverside-applied" in out
    labelled = widget("ssa", ns, replicas=4, policy="Never", args=["a"])
    labelled["metadata"]["labels"] = {"team": "ml"}
    kubectl.apply(labelled, server_side=True)
    got = kubectl.get_json("wg", "ssa", "-n", ns)
    assert got["spec"]["replicas"] == 4 and got["metadata"]["labels"] == {"team": "ml"}
    # Fields this manager applied before and leaves out now are removed (then defaulted).
    kubectl.apply(widget("ssa", ns, replicas=4), server_side=True)
    got = kubectl.get_json("wg", "ssa", "-n", ns)
    assert "labels" not in got["metadata"] and "args" not in got["spec"]
    assert got["spec"]["policy"] == "Always"
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": ns},
          "data": {"a": "1"}}
    kubectl.apply(cm, server_side=True)
    assert kubectl.get_json("cm", "c", "-n", ns)["data"] == {"a": "1"}


def test_builtin_apply_uses_strategic_merge(kubectl, ns):
    dep = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "d", "namespace": ns, "labels": {"app": "d"}},
           "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "d"}},
                    "template": {"metadata": {"labels": {"app": "d"}},
                                 "spec": {"containers": [
                                     {"name": "a", "image": "img:1",
                                      "env": [{"name": "X", "value": "1"}]},
                                     {"name": "b", "image": "img:1"}]}}}}
    kubectl.apply(dep)
    dep["spec"]["template"]["spec"]["containers"][0]["image"] = "img:2"
    kubectl.apply(dep)
    got = kubectl.get_json("deploy", "d", "-n", ns)
    containers = got["spec"]["template"]["spec"]["containers"]
    assert [(c["name"], c["image"]) for c in containers] == [("a", "img:2"), ("b", "img:1")]
    assert containers[0]["env"] == [{"name": "X", "value": "1"}]
    kubectl("scale", "deployment", "d", "-n", ns, "--replicas=3")
    assert kubectl.get_json("deploy", "d", "-n", ns)["spec"]["replicas"] == 3


def test_scale_custom_resource(kubectl, ns):
    kubectl.apply(widget("s", ns, replicas=1))
    kubectl("scale", "wg", "s", "-n", ns, "--replicas=5")
    assert kubectl("get", "wg", "s", "-n", ns, "-o", "jsonpath={.spec.replicas}") == "5"
    # CEL is re-checked after a scale: replicas may not exceed maxReplicas (10)
    err = kubectl.fails("scale", "wg", "s", "-n", ns, "--replicas=50")
    assert "replicas must not exceed maxReplicas" in err


def test_patch_merge_and_json(kubectl, ns):
    kubectl.apply(widget("p", ns))
    kubectl("patch", "wg", "p", "-n", ns, "--type=merge", "-p", '{"spec":{"replicas":4}}')
    kubectl("patch", "wg", "p", "-n", ns, "--type=json",
            "-p", '[{"op":"replace","path":"/spec/maxReplicas","value":20}]')
    got = kubectl.get_json("wg", "p", "-n", ns)
    assert (got["spec"]["replicas"], got["spec"]["maxReplicas"]) == (4, 20)
    err = kubectl.fails("patch", "wg", "p", "-n", ns, "--type=json",
                        "-p", '[{"op":"test","path":"/spec/replicas","value":99}]')
    assert "The request is invalid" in err
    err = kubectl.fails("patch", "wg", "p", "-n", ns, "-p", '{"spec":{"replicas":5}}')
    # kubectl's default patch type is strategic: custom resources answer 415 to it
    assert "UnsupportedMediaType" in err or "unknown format" in err or "unable to" in err


def test_label_selectors(kubectl, ns):
    for name, tier in (("a", "web"), ("b", "db"), ("c", "web")):
        cm = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": name, "namespace": ns, "labels": {"tier": tier}}}
        kubectl.apply(cm)
    names = kubectl("get", "cm", "-n", ns, "-l", "tier=web", "-o", "name").split()
    assert names == ["configmap/a", "configmap/c"]
    names = kubectl("get", "cm", "-n", ns, "-l", "tier in (db)", "-o", "name").split()
    assert names == ["configmap/b"]
    names = kubectl("get", "cm", "-n", ns, "-l", "tier!=web,tier", "-o", "name").split()
    assert names == ["configmap/b"]
    names = kubectl("get", "cm", "-n", ns, "--field-selector", "metadata.name=c",
                    "-o", "name").split()
    assert names == ["configmap/c"]
    kubectl("label", "cm", "a", "-n", ns, "tier=db", "--overwrite")
    assert len(kubectl("get", "cm", "-n", ns, "-l", "tier=db", "-o", "name").split()) == 2


def test_get_watch_sees_changes(kubectl, ns):
    kubectl.apply(widget("watched", ns))
    proc = subprocess.Popen([str(kubectl.binary), "get", "wg", "-n", ns, "-w",
                             "--request-timeout=20s", "-o", "name"],
                            env=kubectl.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().strip()
        assert first == "widget.example.dev/watched"
        kubectl.apply(widget("second", ns))
        assert proc.stdout.readline().strip() == "widget.example.dev/second"
    finally:
        proc.kill()
        proc.wait()
    # The default output watches Table rows: the printer columns come through the watch too.
    table = subprocess.Popen([str(kubectl.binary), "get", "wg", "-n", ns, "-w",
                              "--request-timeout=20s"], env=kubectl.env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert table.stdout is not None
        assert table.stdout.readline().split()[:3] == ["NAME", "REPLICAS", "PHASE"]
        seen = {table.stdout.readline().split()[0], table.stdout.readline().split()[0]}
        assert seen == {"watched", "second"}
        kubectl("patch", "wg", "second", "-n", ns, "--type=merge", "-p",
                '{"spec":{"replicas":7}}')
        assert table.stdout.readline().split()[:2] == ["second", "7"]
    finally:
        table.kill()
        table.wait()


def _watching(server, before):
    return lambda: server.call(
        lambda: server.server.store.watcher_count("example.dev/widgets")) > before


def test_wait_for_condition_and_delete(api, kubectl, ns):  # noqa: F811 (fixture)
    kubectl.apply(widget("waiter", ns))
    before = api.call(lambda: api.server.store.watcher_count("example.dev/widgets"))
    waiter = subprocess.Popen([str(kubectl.binary), "wait", "wg/waiter", "-n", ns,
                               "--for=condition=Ready", "--timeout=20s"], env=kubectl.env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(_watching(api, before), what="kubectl wait to watch")
    kubectl("patch", "wg", "waiter", "-n", ns, "--type=merge", "--subresource=status", "-p",
            '{"status":{"conditions":[{"type":"Ready","status":"True"}]}}'
            ) if not kubectl.old else _status_patch_via_raw(kubectl, ns, "waiter")
    out, err = waiter.communicate(timeout=25)
    assert waiter.returncode == 0, err
    assert "condition met" in out
    deleter = subprocess.Popen([str(kubectl.binary), "wait", "wg/waiter", "-n", ns,
                                "--for=delete", "--timeout=20s"], env=kubectl.env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(_watching(api, before), what="kubectl wait to watch")
    kubectl("delete", "wg", "waiter", "-n", ns)
    out, err = deleter.communicate(timeout=25)
    assert deleter.returncode == 0, err


def _status_patch_via_raw(kubectl, ns, name):
    # kubectl 1.20 has no --subresource; write the status through the API directly.
    from urllib.request import Request, urlopen

    with open(kubectl.env["KUBECONFIG"]) as f:
        cfg = yaml.safe_load(f)
    url = cfg["clusters"][0]["cluster"]["server"]
    body = json.dumps({"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    req = Request(f"{url}/apis/example.dev/v1/namespaces/{ns}/widgets/{name}/status",
                  data=body.encode(), method="PATCH",
                  headers={"Content-Type": "application/merge-patch+json"})
    with urlopen(req) as resp:
        assert resp.status == 200


def test_delete_waits_for_finalizers(kubectl, ns):
    w = widget("fin", ns)
    w["metadata"]["finalizers"] = ["example.dev/keep"]
    kubectl.apply(w)
    kubectl("delete", "wg", "fin", "-n", ns, "--wait=false")
    got = kubectl.get_json("wg", "fin", "-n", ns)
    assert got["metadata"]["deletionTimestamp"]
    kubectl("patch", "wg", "fin", "-n", ns, "--type=json",
            "-p", '[{"op":"remove","path":"/metadata/finalizers"}]')
    assert kubectl.run("get", "wg", "fin", "-n", ns, check=False).returncode != 0


@pytest.mark.parametrize("cascade", ["background", "foreground", "orphan"])
def test_cascading_delete(kubectl, ns, cascade):
    if kubectl.old and cascade == "foreground":
        pytest.skip("kubectl 1.20 only knows --cascade=true|false")
    owner = kubectl.apply({"apiVersion": "v1", "kind": "ConfigMap",
                           "metadata": {"name": "owner", "namespace": ns}})
    assert owner
    uid = kubectl.get_json("cm", "owner", "-n", ns)["metadata"]["uid"]
    kubectl.apply({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": "dep", "namespace": ns, "ownerReferences": [
                       {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid,
                        "blockOwnerDeletion": True}]}})
    flag = {"background": "true", "orphan": "false"}.get(cascade, cascade) if kubectl.old else (
        cascade)
    kubectl("delete", "cm", "owner", "-n", ns, f"--cascade={flag}", "--timeout=20s")

    def dep_state():
        done = kubectl.run("get", "cm", "dep", "-n", ns, "-o", "json", check=False)
        return "gone" if done.returncode != 0 else json.loads(done.stdout)

    if cascade == "orphan":
        dep = wait_for(lambda: (lambda d: d if d != "gone" and not d["metadata"].get(
            "ownerReferences") else None)(dep_state()), what="orphaned dependent")
        assert dep["metadata"]["name"] == "dep"
    else:
        wait_for(lambda: dep_state() == "gone", what="dependent collected")
    assert kubectl.run("get", "cm", "owner", "-n", ns, check=False).returncode != 0


def test_schema_rejections_show_the_real_error_text(kubectl, ns):
    bad = widget("bad", ns, replicas=0, policy="Sometimes")
    err = kubectl.fails("apply", "-f", "-", input=yaml.safe_dump(bad))
    assert ("spec.replicas: Invalid value: 0: spec.replicas in body should be greater than or "
            "equal to 1") in err
    assert 'spec.policy: Unsupported value: "Sometimes": supported values: "Always", "Never"' in err
    assert 'The Widget "bad" is invalid' in err
    unknown = widget("bad", ns, foo=1)
    if kubectl.old:
        # kubectl 1.20 sends no fieldValidation: the server warns and prunes the field.
        done = kubectl.run("create", "-f", "-", input=yaml.safe_dump(unknown))
        assert 'unknown field "spec.foo"' in done.stderr
        assert "foo" not in kubectl.get_json("wg", "bad", "-n", ns)["spec"]
    else:
        err = kubectl.fails("create", "-f", "-", input=yaml.safe_dump(unknown))
        assert 'strict decoding error: unknown field "spec.foo"' in err
    err = kubectl.fails("apply", "-f", "-", input=yaml.safe_dump(widget("cel", ns,
                                                                       replicas=50)))
    assert 'spec: Invalid value: "object": replicas must not exceed maxReplicas' in err


def test_invalid_name_and_unknown_resource(kubectl, ns):
    err = kubectl.fails("apply", "-f", "-", input=yaml.safe_dump(widget("Bad_Name", ns)))
    assert 'metadata.name: Invalid value: "Bad_Name": a lowercase RFC 1123 subdomain' in err
    err = kubectl.fails("get", "gizmos")
    assert "the server doesn't have a resource type \"gizmos\"" in err
    err = kubectl.fails("get", "wg", "missing", "-n", ns)
    assert 'widgets.example.dev "missing" not found' in err
