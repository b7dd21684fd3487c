"""Bad input gets the real server's status codes and reasons, and the server keeps serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from api_helpers import api, widget, widget_crd  # noqa: F401  (fixture)


def call(server, method, path, body=None, ctype="application/json"):
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def srv(api):  # noqa: F811
    status, _ = call(api, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                     widget_crd())
    assert status in (201, 409)
    return api


def assert_status(result, code, reason):
    status, body = result
    assert status == code, body
    assert body["kind"] == "Status" and body["apiVersion"] == "v1"
    assert body["status"] == "Failure" and body["code"] == code and body["reason"] == reason
    return body


def test_malformed_json_and_yaml(srv):
    assert_status(call(srv, "POST", "/api/v1/namespaces/default/configmaps", b"{not json"),
                  400, "BadRequest")
    assert_status(call(srv, "POST", "/api/v1/namespaces/default/configmaps", b"a: [b",
                       "application/yaml"), 400, "BadRequest")
    assert_status(call(srv, "POST", "/api/v1/namespaces/default/configmaps", b"[1, 2]"),
                  400, "BadRequest")
    assert_status(call(srv, "PATCH", "/api/v1/namespaces/default/configmaps/x", b"{}",
                       "text/plain"), 415, "UnsupportedMediaType")


def test_unknown_resources_and_paths(srv):
    body = assert_status(call(srv, "GET", "/api/v1/namespaces/default/gizmos"), 404, "NotFound")
    assert body["message"] == "the server could not find the requested resource"
    assert_status(call(srv, "GET", "/apis/nope.dev/v1/things"), 404, "NotFound")
    assert_status(call(srv, "GET", "/apis/nope.dev"), 404, "NotFound")
    assert_status(call(srv, "PUT", "/api/v1/namespaces/default/configmaps"), 405,
                  "MethodNotAllowed")


def test_invalid_names(srv):
    body = assert_status(call(srv, "POST", "/api/v1/namespaces/default/configmaps",
                              {"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": {"name": "Bad_Name"}}), 422, "Invalid")
    assert body["message"].startswith('ConfigMap "Bad_Name" is invalid: metadata.name: Invalid '
                                      'value: "Bad_Name": a lowercase RFC 1123 subdomain')
    assert body["details"]["causes"][0]["field"] == "metadata.name"
    assert body["details"]["causes"][0]["reason"] == "FieldValueInvalid"
    body = assert_status(call(srv, "POST", "/api/v1/namespaces",
                              {"metadata": {"name": "has.dot"}}), 422, "Invalid")
    assert "a lowercase RFC 1123 label must consist of" in body["message"]
    body = assert_status(call(srv, "POST", "/api/v1/namespaces/default/configmaps",
                              {"metadata": {}}), 422, "Invalid")
    assert "metadata.name: Required value: name or generateName is required" in body["message"]
    created = call(srv, "POST", "/api/v1/namespaces/default/configmaps",
                   {"metadata": {"generateName": "gen-"}})
    assert created[0] == 201 and created[1]["metadata"]["name"].startswith("gen-")
    assert len(created[1]["metadata"]["name"]) == len("gen-") + 5


def test_oversize_objects(srv):
    big = {"metadata": {"name": "big"}, "data": {"k": "x" * (1024 * 1024 + 10)}}
    body = assert_status(call(srv, "POST", "/api/v1/namespaces/default/configmaps", big),
                         422, "Invalid")
    assert "Too long: must have at most 1048576 bytes" in body["message"]
    huge = widget("huge", extra={"blob": "y" * (1600 * 1024)})
    assert_status(call(srv, "POST", "/apis/example.dev/v1/namespaces/default/widgets", huge),
                  413, "RequestEntityTooLarge")
    enormous = b'{"metadata":{"name":"e"},"data":{"k":"' + b"z" * (3 * 1024 * 1024) + b'"}}'
    assert_status(call(srv, "POST", "/api/v1/namespaces/default/configmaps", enormous),
                  413, "RequestEntityTooLarge")


def test_patches_on_missing_objects_and_wrong_types(srv):
    body = assert_status(call(srv, "PATCH", "/api/v1/namespaces/default/configmaps/nothere",
                              {"data": {}}, "application/merge-patch+json"), 404, "NotFound")
    assert body["message"] == 'configmaps "nothere" not found'
    call(srv, "POST", "/apis/example.dev/v1/namespaces/default/widgets", widget("sm"))
    assert_status(call(srv, "PATCH", "/apis/example.dev/v1/namespaces/default/widgets/sm",
                       {"spec": {}}, "application/strategic-merge-patch+json"),
                  415, "UnsupportedMediaType")
    assert_status(call(srv, "PATCH", "/apis/example.dev/v1/namespaces/default/widgets/sm",
                       [{"op": "test", "path": "/metadata/resourceVersion", "value": "1"}],
                       "application/json-patch+json"), 422, "Invalid")
    assert_status(call(srv, "PATCH", "/apis/example.dev/v1/namespaces/default/widgets/sm",
                       [{"op": "remove", "path": "/spec/nothing"}],
                       "application/json-patch+json"), 422, "Invalid")


def test_stale_resource_versions(srv):
    status, obj = call(srv, "POST", "/api/v1/namespaces/default/configmaps",
                       {"metadata": {"name": "stale"}, "data": {"a": "1"}})
    assert status == 201
    call(srv, "PATCH", "/api/v1/namespaces/default/configmaps/stale", {"data": {"a": "2"}},
         "application/merge-patch+json")
    body = assert_status(call(srv, "PUT", "/api/v1/namespaces/default/configmaps/stale", obj),
                         409, "Conflict")
    assert "the object has been modified" in body["message"]
    patch = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]},
             "data": {"a": "3"}}
    assert_status(call(srv, "PATCH", "/api/v1/namespaces/default/configmaps/stale", patch,
                       "application/merge-patch+json"), 409, "Conflict")
    body = assert_status(call(srv, "DELETE", "/api/v1/namespaces/default/configmaps/stale",
                              {"preconditions": {"resourceVersion": "1"}}), 409, "Conflict")
    assert "Precondition failed" in body["message"]


def test_mismatched_namespace_and_missing_namespace(srv):
    assert_status(call(srv, "POST", "/api/v1/namespaces/default/configmaps",
                       {"metadata": {"name": "x", "namespace": "other"}}), 400, "BadRequest")
    body = assert_status(call(srv, "POST", "/api/v1/namespaces/ghost/configmaps",
                              {"metadata": {"name": "x"}}), 404, "NotFound")
    assert body["message"] == 'namespaces "ghost" not found'


def test_server_keeps_serving_after_bad_input(srv):
    for _ in range(3):
        call(srv, "POST", "/api/v1/namespaces/default/pods", b"\xff\xfe garbage")
    status, body = call(srv, "GET", "/api/v1/namespaces/default/configmaps")
    assert status == 200 and body["kind"] == "ConfigMapList"
    assert body["metadata"]["resourceVersion"]


def test_wrong_json_types_in_builtin_kinds(srv):
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "typed"},
           "spec": {"replicas": "two", "selector": {"matchLabels": {"a": "b"}},
                    "template": {"metadata": {"labels": {"a": "b"}},
                                 "spec": {"containers": [{"name": "c", "image": "x"}]}}}}
    body = assert_status(call(srv, "POST", "/apis/apps/v1/namespaces/default/deployments", dep),
                         400, "BadRequest")
    assert body["message"] == (
        'Deployment in version "v1" cannot be handled as a Deployment: json: cannot unmarshal '
        "string into Go struct field DeploymentSpec.spec.replicas of type int32")


def test_bad_query_parameters(srv):
    assert_status(call(srv, "GET", "/api/v1/namespaces/default/configmaps?limit=ten"),
                  400, "BadRequest")
    assert_status(call(srv, "GET", "/api/v1/namespaces/default/configmaps?watch=true"
                                   "&timeoutSeconds=soon"), 400, "BadRequest")
    assert_status(call(srv, "GET", "/api/v1/namespaces/default/configmaps?labelSelector=a%20in"
                                   "%20(b"), 400, "BadRequest")
    status, body = call(srv, "GET", "/api/v1/namespaces/default/configmaps?limit=1")
    assert status == 200 and body["kind"] == "ConfigMapList"


MALFORMED = [
    {"metadata": {"name": 5}},
    {"metadata": {"name": "a", "labels": "x"}},
    {"metadata": {"name": "b", "finalizers": "x"}},
    {"metadata": {"name": "c", "ownerReferences": [5]}},
    {"metadata": {"name": "d", "annotations": {"a": 5}}},
    {"metadata": "x"},
    {"metadata": {"name": "e"}, "spec": []},
    {"metadata": {"name": "f"}, "spec": {"image": "x", "replicas": 10**30}},
    {"metadata": {"name": "g"}, "spec": {"image": "x", "extra": {"big": 10**30}}},
    {"metadata": {"name": "h"}, "spec": {"image": "x", "volumes": [1, "a"]}},
]


BEYOND_INT64 = MALFORMED[8]  # malformed for typed kinds, not under preserved unknown fields
PATHS = ["/api/v1/namespaces/default/pods", "/apis/apps/v1/namespaces/default/deployments",
         "/apis/example.dev/v1/namespaces/default/widgets"]


@pytest.mark.parametrize(("path", "body"), [
    pytest.param(path, body, id=f"{path}-{i}") for path in PATHS
    for i, body in enumerate(MALFORMED)
    if not (path.endswith("/widgets") and body is BEYOND_INT64)])
def test_malformed_objects_are_client_errors(srv, path, body):
    # Regression: wrongly typed metadata and values used to end in 500 Internal error.
    kind = {"pods": ("v1", "Pod"), "deployments": ("apps/v1", "Deployment"),
            "widgets": ("example.dev/v1", "Widget")}[path.rsplit("/", 1)[1]]
    status, answer = call(srv, "POST", path, {"apiVersion": kind[0], "kind": kind[1], **body})
    assert status in (400, 422), answer
    assert answer["kind"] == "Status" and answer["reason"] in ("BadRequest", "Invalid")


def test_scale_patch_that_breaks_the_scale_object(srv):
    call(srv, "POST", "/apis/example.dev/v1/namespaces/default/widgets", widget("scaly"))
    assert_status(call(srv, "PATCH", "/apis/example.dev/v1/namespaces/default/widgets/scaly/"
                       "scale", [{"op": "replace", "path": "/spec", "value": 1}],
                       "application/json-patch+json"), 400, "BadRequest")


def test_a_number_beyond_int64_under_preserved_unknown_fields_is_kept(srv):
    # The real decoder turns an integer beyond int64 into a float64 (apimachinery
    # `pkg/util/json` convertNumber); `spec.extra` preserves unknown fields and no CEL rule
    # reads it, so the object is valid: a 500 or a refusal would both be wrong.
    status, answer = call(srv, "POST", PATHS[2], {"apiVersion": "example.dev/v1",
                                                  "kind": "Widget", **BEYOND_INT64})
    assert status == 201, answer
    assert float(answer["spec"]["extra"]["big"]) == 1e30
