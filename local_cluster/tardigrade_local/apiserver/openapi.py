"""OpenAPI documents: enough for kubectl apply (client and server side), explain and helm.

/openapi/v3 lists one document per group-version; each carries the paths with
`x-kubernetes-group-version-kind` and a `fieldValidation` parameter on PATCH, which is how
kubectl decides that the server validates fields itself. Custom resources carry their CRD
schema. Built-in kinds get an open schema and no strategic-merge media type on PATCH, so
kubectl computes strategic merge patches from its compiled-in types, which are exact.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from aiohttp import web

from .discovery import VERSION_INFO
from .errors import ApiError
from .resources import Registry, ResourceType

_PARAM_NAMES = ("dryRun", "fieldManager", "fieldValidation", "force", "pretty")


def _gv_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def _schema_name(rt: ResourceType) -> str:
    group = ".".join(reversed(rt.group.split("."))) if rt.group else "io.k8s.api.core"
    return f"{group}.{rt.version}.{rt.kind}"


def _gvk(rt: ResourceType) -> dict[str, str]:
    return {"group": rt.group, "version": rt.version, "kind": rt.kind}


def _schema(rt: ResourceType) -> dict[str, Any]:
    if rt.crd is not None:
        version = next((v for v in rt.crd["spec"].get("versions") or []
                        if v.get("name") == rt.version), {})
        schema = json.loads(json.dumps((version.get("schema") or {}).get("openAPIV3Schema")
                                       or {"type": "object"}))
        props = schema.setdefault("properties", {})
        props.setdefault("apiVersion", {"type": "string"})
        props.setdefault("kind", {"type": "string"})
        props.setdefault("metadata", {"type": "object"})
    else:
        schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                  "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                 "metadata": {"type": "object"}}}
    schema["x-kubernetes-group-version-kind"] = [_gvk(rt)]
    return schema


def _op(rt: ResourceType, action: str, ref: str, body: bool,
        patch_types: tuple[str, ...] = ()) -> dict[str, Any]:
    op: dict[str, Any] = {
        "operationId": f"{action}{rt.kind}",
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": _gvk(rt),
        "parameters": [{"name": n, "in": "query", "schema": {"type": "string"},
                        "uniqueItems": True} for n in _PARAM_NAMES],
        "responses": {"200": {"description": "OK", "content": {
            "application/json": {"schema": {"$ref": ref}}}}},
    }
    if body:
        types = patch_types or ("application/json", "application/yaml")
        op["requestBody"] = {"content": {t: {"schema": {"$ref": ref}} for t in types},
                             "required": True}
    return op


def gv_document(registry: Registry, group: str, version: str) -> dict[str, Any] | None:
    types = registry.in_group_version(group, version)
    if not types:
        return None
    paths: dict[str, Any] = {}
    schemas: dict[str, Any] = {}
    patch_types = ("application/json-patch+json", "application/merge-patch+json",
                   "application/apply-patch+yaml")
    for rt in types:
        name = _schema_name(rt)
        schemas[name] = _schema(rt)
        ref = f"#/components/schemas/{name}"
        base = "/" + _gv_path(group, version)
        coll = f"{base}/namespaces/{{namespace}}/{rt.plural}" if rt.namespaced else (
            f"{base}/{rt.plural}")
        paths[coll] = {"get": _op(rt, "list", ref, False), "post": _op(rt, "post", ref, True)}
        item = {"get": _op(rt, "get", ref, False), "put": _op(rt, "put", ref, True),
                "patch": _op(rt, "patch", ref, True, patch_types),
                "delete": _op(rt, "delete", ref, False)}
        paths[f"{coll}/{{name}}"] = item
        if rt.status_subresource:
            paths[f"{coll}/{{name}}/status"] = {
                "get": _op(rt, "get", ref, False), "put": _op(rt, "put", ref, True),
                "patch": _op(rt, "patch", ref, True, patch_types)}
    return {"openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": VERSION_INFO["gitVersion"]},
            "paths": paths, "components": {"schemas": schemas}}


def _v3_root(registry: Registry) -> dict[str, Any]:
    out = {}
    for group, versions in registry.group_versions().items():
        for version in versions:
            doc = gv_document(registry, group, version)
            digest = hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:128]
            path = _gv_path(group, version)
            out[path] = {"serverRelativeURL": f"/openapi/v3/{path}?hash={digest.upper()}"}
    return {"paths": out}


def _swagger_v2(registry: Registry) -> dict[str, Any]:
    definitions = {}
    for rt in registry.all():
        if rt.crd is not None:
            definitions[_schema_name(rt)] = _schema(rt)
    return {"swagger": "2.0",
            "info": {"title": "Kubernetes", "version": VERSION_INFO["gitVersion"]},
            "paths": {}, "definitions": definitions}


def _pb_string(field: int, text: str) -> bytes:
    data = text.encode()
    return bytes([(field << 3) | 2]) + _varint(len(data)) + data


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _swagger_v2_protobuf() -> bytes:
    """A minimal gnostic openapi_v2.Document (swagger + info).

    kubectl 1.20 only accepts /openapi/v2 as protobuf; with no definitions it skips client
    side validation of a kind and computes patches from its compiled-in types.
    """
    info = _pb_string(1, "Kubernetes") + _pb_string(2, VERSION_INFO["gitVersion"])
    return _pb_string(1, "2.0") + bytes([(2 << 3) | 2]) + _varint(len(info)) + info


def serve(request: web.Request, registry: Registry) -> web.Response:
    path = request.path.rstrip("/")
    if path == "/openapi/v2":
        if "protobuf" in request.headers.get("Accept", ""):
            return web.Response(body=_swagger_v2_protobuf(), content_type=(
                "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"))
        return web.json_response(_swagger_v2(registry))
    if path == "/openapi/v3":
        return web.json_response(_v3_root(registry))
    if path.startswith("/openapi/v3/"):
        rest = path[len("/openapi/v3/"):].split("/")
        doc = None
        if rest[0] == "api" and len(rest) == 2:
            doc = gv_document(registry, "", rest[1])
        elif rest[0] == "apis" and len(rest) == 3:
            doc = gv_document(registry, rest[1], rest[2])
        if doc is not None:
            return web.json_response(doc, headers={"Cache-Control": "no-cache"})
    err = ApiError(404, "NotFound", "the server could not find the requested resource", {})
    return web.json_response(err.status(), status=404)
