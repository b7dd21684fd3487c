"""Discovery and OpenAPI documents, including CRDs registered and removed at runtime."""

from __future__ import annotations

import json
import urllib.request

from api_helpers import api, wait_for, widget_crd  # noqa: F401  (fixture)

AGGREGATED = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"


def get(server, path, accept="application/json"):
    req = urllib.request.Request(server.url + path, headers={"Accept": accept})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type"), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type"), json.loads(err.read())


def send(server, method, path, body):
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_version_api_and_groups(api):  # noqa: F811
    _, _, version = get(api, "/version")
    assert version["major"] == "1" and version["gitVersion"].startswith("v1.")
    _, _, core = get(api, "/api")
    assert core["kind"] == "APIVersions" and core["versions"] == ["v1"]
    _, _, groups = get(api, "/apis")
    names = [g["name"] for g in groups["groups"]]
    for group in ("apps", "coordination.k8s.io", "events.k8s.io", "policy",
                  "rbac.authorization.k8s.io", "apiextensions.k8s.io"):
        assert group in names


def test_resource_lists_have_subresources_and_short_names(api):  # noqa: F811
    _, _, core = get(api, "/api/v1")
    by_name = {r["name"]: r for r in core["resources"]}
    assert by_name["pods"]["shortNames"] == ["po"] and by_name["pods"]["namespaced"]
    assert by_name["pods/status"]["verbs"] == ["get", "patch", "update"]
    assert by_name["pods/eviction"]["group"] == "policy"
    assert by_name["nodes"]["namespaced"] is False
    _, _, apps = get(api, "/apis/apps/v1")
    scale = {r["name"]: r for r in apps["resources"]}["deployments/scale"]
    assert (scale["group"], scale["version"], scale["kind"]) == ("autoscaling", "v1", "Scale")


def test_crds_appear_and_disappear_at_runtime(api):  # noqa: F811
    crd = widget_crd()
    crd["metadata"]["name"] = "gadgets.runtime.dev"
    crd["spec"]["group"] = "runtime.dev"
    crd["spec"]["names"] = {"plural": "gadgets", "kind": "Gadget", "shortNames": ["gd"]}
    assert send(api, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                crd) == 201
    _, _, listing = get(api, "/apis/runtime.dev/v1")
    names = {r["name"]: r for r in listing["resources"]}
    assert names["gadgets"]["shortNames"] == ["gd"]
    assert names["gadgets/scale"]["kind"] == "Scale"
    assert names["gadgets/status"]["kind"] == "Gadget"
    _, ctype, agg = get(api, "/apis", AGGREGATED + ",application/json")
    assert ctype == AGGREGATED
    group = next(i for i in agg["items"] if i["metadata"].get("name") == "runtime.dev")
    resource = group["versions"][0]["resources"][0]
    assert resource["resource"] == "gadgets" and resource["scope"] == "Namespaced"
    assert {s["subresource"] for s in resource["subresources"]} == {"status", "scale"}
    _, _, crd_status = get(api, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                                "gadgets.runtime.dev")
    established = {c["type"]: c["status"] for c in crd_status["status"]["conditions"]}
    assert established == {"NamesAccepted": "True", "Established": "True"}
    req = urllib.request.Request(
        api.url + "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/gadgets.runtime.dev",
        method="DELETE")
    with urllib.request.urlopen(req) as resp:
        assert resp.status == 200
    wait_for(lambda: get(api, "/apis/runtime.dev/v1")[0] == 404, what="group gone")
    status, _, body = get(api, "/apis/runtime.dev/v1/namespaces/default/gadgets")
    assert status == 404 and body["reason"] == "NotFound"


def test_deleting_a_crd_deletes_its_resources_honouring_finalizers(api):  # noqa: F811
    crd = widget_crd()
    crd["metadata"]["name"] = "doomeds.doom.dev"
    crd["spec"]["group"] = "doom.dev"
    crd["spec"]["names"] = {"plural": "doomeds", "kind": "Doomed"}
    assert send(api, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                crd) == 201
    base = "/apis/doom.dev/v1/namespaces/default/doomeds"
    held = {"apiVersion": "doom.dev/v1", "kind": "Doomed",
            "metadata": {"name": "held", "finalizers": ["doom.dev/hold"]},
            "spec": {"image": "x"}}
    assert send(api, "POST", base, held) == 201
    assert send(api, "POST", base, {**held, "metadata": {"name": "free"}}) == 201
    crd_path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/doomeds.doom.dev"
    assert send(api, "DELETE", crd_path, {}) == 200
    wait_for(lambda: get(api, f"{base}/free")[0] == 404, what="free resource deleted")
    _, _, obj = get(api, f"{base}/held")
    assert obj["metadata"]["deletionTimestamp"]
    assert get(api, crd_path)[2]["metadata"]["deletionTimestamp"]
    assert send(api, "POST", base, {**held, "metadata": {"name": "late"}}) == 405
    patch = urllib.request.Request(api.url + f"{base}/held", method="PATCH",
                                   data=b'{"metadata":{"finalizers":null}}',
                                   headers={"Content-Type": "application/merge-patch+json"})
    with urllib.request.urlopen(patch) as resp:
        assert resp.status == 200
    wait_for(lambda: get(api, crd_path)[0] == 404, what="CRD gone")


def test_openapi_v3_patch_operations_declare_field_validation(api):  # noqa: F811
    send(api, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", widget_crd())
    _, _, root = get(api, "/openapi/v3")
    url = root["paths"]["apis/example.dev/v1"]["serverRelativeURL"]
    _, _, doc = get(api, url)
    item = doc["paths"]["/apis/example.dev/v1/namespaces/{namespace}/widgets/{name}"]
    patch = item["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {"group": "example.dev", "version": "v1",
                                                        "kind": "Widget"}
    assert "fieldValidation" in [p["name"] for p in patch["parameters"]]
    assert "application/strategic-merge-patch+json" not in patch["requestBody"]["content"]
    schema = next(iter(doc["components"]["schemas"].values()))
    assert schema["properties"]["spec"]["properties"]["replicas"]["minimum"] == 1


def test_metadata_only_answers(api):  # noqa: F811
    accept = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
    _, _, listing = get(api, "/api/v1/namespaces", accept)
    assert listing["kind"] == "PartialObjectMetadataList"
    assert {"kind", "apiVersion", "metadata"} == set(listing["items"][0])
    _, _, one = get(api, "/api/v1/namespaces/default",
                    "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1")
    assert one["kind"] == "PartialObjectMetadata" and one["metadata"]["name"] == "default"


def test_slow_watchers_are_cut_off(api):  # noqa: F811
    from tardigrade_local.apiserver.store import Watcher

    def make():
        store = api.server.store
        watcher = store.subscribe("/configmaps", None)
        old = Watcher.MAX_BACKLOG
        Watcher.MAX_BACKLOG = 2
        try:
            for i in range(4):
                api.server.create_object("v1", "ConfigMap", {"metadata": {"name": f"slow-{i}"}},
                                         "default")
        finally:
            Watcher.MAX_BACKLOG = old
            store.unsubscribe(watcher)
        return watcher.cut_off, watcher.queue.qsize()

    cut_off, queued = api.call(make)
    assert cut_off and queued == 3  # two events, then the end-of-stream marker


def test_updating_a_crd_changes_what_is_enforced(api):  # noqa: F811
    # Regression: an updated CRD kept being served with the schema it was created with.
    crd = widget_crd()
    crd["metadata"]["name"] = "morphs.morph.dev"
    crd["spec"]["group"] = "morph.dev"
    crd["spec"]["names"] = {"plural": "morphs", "kind": "Morph"}
    path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    assert send(api, "POST", path, crd) == 201
    base = "/apis/morph.dev/v1/namespaces/default/morphs"
    obj = {"apiVersion": "morph.dev/v1", "kind": "Morph", "metadata": {"name": "m1"},
           "spec": {"image": "x", "replicas": 50, "maxReplicas": 60}}
    assert send(api, "POST", base, obj) == 201
    version = crd["spec"]["versions"][0]
    version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["replicas"][
        "minimum"] = 100
    _, _, current = get(api, f"{path}/morphs.morph.dev")
    crd["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    assert send(api, "PUT", f"{path}/morphs.morph.dev", crd) == 200
    obj["spec"] = {"image": "x", "replicas": 99, "maxReplicas": 99}
    req = urllib.request.Request(api.url + base, data=json.dumps(obj).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req)
        raise AssertionError("the new minimum was not enforced")
    except urllib.error.HTTPError as err:
        assert err.code == 422
        assert "should be greater than or equal to 100" in json.loads(err.read())["message"]
