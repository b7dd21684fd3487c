"""Hostile request bodies and headers get what kube-apiserver gives them (or, for the Host
header, what a loopback dev server must: see hostcheck.py), and the server keeps serving."""

from __future__ import annotations

import http.client
import json
import urllib.parse

import pytest
from api_helpers import api, widget, widget_crd  # noqa: F401  (fixture)

WIDGETS = "/apis/example.dev/v1/namespaces/default/widgets"
CONFIGMAPS = "/api/v1/namespaces/default/configmaps"


def request(server, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    """One raw HTTP request: urllib would fill in Content-Type and Host itself."""
    url = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_host="Host" in (headers or {}),
                        skip_accept_encoding=True)
        for key, value in (headers or {}).items():
            conn.putheader(key, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, dict(resp.getheaders()), raw
    finally:
        conn.close()


def status_of(raw: bytes) -> dict:
    body = json.loads(raw)
    assert body["kind"] == "Status" and body["status"] == "Failure", body
    return body


@pytest.fixture(scope="module")
def srv(api):  # noqa: F811
    code, _, _ = request(api, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                         json.dumps(widget_crd()).encode(),
                         {"Content-Type": "application/json"})
    assert code in (201, 409)
    return api


def nested(depth: int) -> dict:
    """{"n": {"n": ... {"n": 1}}} with `depth` objects in all."""
    value: object = 1
    for _ in range(depth):
        value = {"n": value}
    assert isinstance(value, dict)
    return value


def depth_of(value: object) -> int:
    depth = 0
    while isinstance(value, dict):
        value, depth = value["n"], depth + 1
    return depth


def deep_widget_body(name: str, depth: int) -> bytes:
    # The widget, its spec and `extra` are three levels; the rest nests inside `extra`.
    head = json.dumps(widget(name, extra={"n": "HOLE"}))
    inner = '{"n":' * (depth - 3) + "1" + "}" * (depth - 3)
    return head.replace('"HOLE"', inner).encode()


def test_deep_objects_are_stored_as_deep_as_the_real_server_allows(srv):
    # A real server stores a trainer config 1,000 levels deep (Go's JSON decoder allows
    # 10,000); this server refused it with a 500 (RecursionError) before.
    for name, depth in (("deep-1k", 1000), ("deep-10k", 10_000)):
        code, _, raw = request(srv, "POST", WIDGETS, deep_widget_body(name, depth),
                               {"Content-Type": "application/json"})
        assert code == 201, raw[:300]
        code, _, raw = request(srv, "GET", f"{WIDGETS}/{name}")
        assert code == 200
        assert depth_of(json.loads(raw)["spec"]["extra"]) == depth - 2


def test_one_level_deeper_than_go_is_a_bad_request(srv):
    code, _, raw = request(srv, "POST", WIDGETS, deep_widget_body("too-deep", 10_001),
                           {"Content-Type": "application/json"})
    assert code == 400
    body = status_of(raw)
    assert body["reason"] == "BadRequest"
    assert "invalid character '{' exceeded max depth" in body["message"]


def test_watchers_get_deep_objects(srv):
    code, _, raw = request(srv, "GET", f"{WIDGETS}?limit=1")
    version = json.loads(raw)["metadata"]["resourceVersion"]
    url = urllib.parse.urlsplit(srv.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request("GET", f"{WIDGETS}?watch=true&resourceVersion={version}"
                            f"&fieldSelector=metadata.name%3Ddeep-watched")
        stream = conn.getresponse()
        assert stream.status == 200
        code, _, _ = request(srv, "POST", WIDGETS, deep_widget_body("deep-watched", 2000),
                             {"Content-Type": "application/json"})
        assert code == 201
        line = stream.readline()
    finally:
        conn.close()
    event = json.loads(line)
    assert event["type"] == "ADDED"
    assert depth_of(event["object"]["spec"]["extra"]) == 2000 - 2


def billion_laughs() -> bytes:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    return ("\n".join(lines) + "\n").encode()


def test_yaml_alias_expansion_is_bounded_like_go_yaml(srv):
    body = billion_laughs()
    assert len(body) < 500
    code, _, raw = request(srv, "POST", CONFIGMAPS, body, {"Content-Type": "application/yaml"})
    assert code == 400
    assert status_of(raw)["message"] == ("error converting YAML to JSON: yaml: document "
                                         "contains excessive aliasing")
    code, _, raw = request(srv, "POST", CONFIGMAPS, b"metadata: &m {name: self}\ndata: *m\n",
                           {"Content-Type": "application/yaml"})
    assert code == 201, raw
    assert json.loads(raw)["data"] == {"name": "self"}
    code, _, raw = request(srv, "POST", CONFIGMAPS, b"metadata: &m {name: loop, x: *m}\n",
                           {"Content-Type": "application/yaml"})
    assert code == 400
    assert "anchor 'm' value contains itself" in status_of(raw)["message"]


def test_writes_need_a_kubernetes_media_type(srv):
    cm = json.dumps({"metadata": {"name": "typed"}, "data": {"a": "1"}}).encode()
    # text/plain is what a web page can send to loopback without a CORS preflight.
    code, _, raw = request(srv, "POST", CONFIGMAPS, cm, {"Content-Type": "text/plain"})
    assert code == 415
    body = status_of(raw)
    assert body["reason"] == "UnsupportedMediaType"
    assert body["message"] == ("the body of the request was in an unknown format - accepted "
                               "media types include: application/json, application/yaml, "
                               "application/vnd.kubernetes.protobuf")
    code, _, raw = request(srv, "POST", WIDGETS, json.dumps(widget("typed")).encode(),
                           {"Content-Type": "application/x-www-form-urlencoded"})
    assert code == 415
    assert status_of(raw)["message"].endswith("include: application/json, application/yaml")
    code, _, raw = request(srv, "PATCH", f"{CONFIGMAPS}/typed", b'{"data":{"a":"2"}}',
                           {"Content-Type": "text/plain"})
    assert code == 415
    assert "application/merge-patch+json" in status_of(raw)["message"]
    # No Content-Type at all reads as JSON, the first type the serializer offers.
    code, _, raw = request(srv, "POST", CONFIGMAPS, cm)
    assert code == 201, raw
    code, _, raw = request(srv, "PATCH", f"{CONFIGMAPS}/typed", b'{"data":{"a":"2"}}',
                           {"Content-Type": "application/merge-patch+json; charset=utf-8"})
    assert code == 200 and json.loads(raw)["data"] == {"a": "2"}


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "localhost.evil.example",
                                  "127.0.0.1.nip.io:6443"])
def test_a_host_header_naming_another_host_is_refused(srv, host):
    code, _, raw = request(srv, "GET", CONFIGMAPS, headers={"Host": host})
    assert code == 403
    body = status_of(raw)
    assert body["reason"] == "Forbidden" and "DNS rebinding" in body["message"]


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:6443", "127.0.0.1", "[::1]:6443",
                                  "kubernetes.default.svc"])
def test_local_host_headers_are_served(srv, host):
    code, _, raw = request(srv, "GET", CONFIGMAPS, headers={"Host": host})
    assert code == 200, raw
