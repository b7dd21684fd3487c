"""Decoding `application/vnd.kubernetes.protobuf` request bodies for common built-in kinds.

Current kubectl sends protobuf from its typed clients (`kubectl create namespace|configmap|
secret|serviceaccount|deployment|job|token`, `kubectl auth can-i`, evictions from
`kubectl drain`). Answers stay JSON,
which those clients accept. The field numbers are those of k8s.io/api's generated.proto;
kinds not described here answer 415 like a server without protobuf support would.
"""

from __future__ import annotations

from typing import Any

from .errors import ApiError

MAGIC = b"k8s\x00"

# A field spec: (json name, kind, nested message name or None)
# kinds: str, bytes, int, bool, msg, map_str, map_bytes, map_msg, rep_str, rep_msg, time
Spec = dict[int, tuple[str, str, str | None]]

MESSAGES: dict[str, Spec] = {
    "ObjectMeta": {1: ("name", "str", None), 2: ("generateName", "str", None),
                   3: ("namespace", "str", None), 5: ("uid", "str", None),
                   6: ("resourceVersion", "str", None), 11: ("labels", "map_str", None),
                   12: ("annotations", "map_str", None),
                   13: ("ownerReferences", "rep_msg", "OwnerReference"),
                   14: ("finalizers", "rep_str", None)},
    "OwnerReference": {1: ("kind", "str", None), 3: ("name", "str", None),
                       4: ("uid", "str", None), 5: ("apiVersion", "str", None),
                       6: ("controller", "bool", None), 7: ("blockOwnerDeletion", "bool", None)},
    "Namespace": {1: ("metadata", "msg", "ObjectMeta"), 2: ("spec", "msg", "NamespaceSpec")},
    "NamespaceSpec": {1: ("finalizers", "rep_str", None)},
    "ConfigMap": {1: ("metadata", "msg", "ObjectMeta"), 2: ("data", "map_str", None),
                  3: ("binaryData", "map_bytes", None), 4: ("immutable", "bool", None)},
    "Secret": {1: ("metadata", "msg", "ObjectMeta"), 2: ("data", "map_bytes", None),
               3: ("type", "str", None), 4: ("stringData", "map_str", None),
               5: ("immutable", "bool", None)},
    "ServiceAccount": {1: ("metadata", "msg", "ObjectMeta"),
                       4: ("automountServiceAccountToken", "bool", None)},
    "LabelSelector": {1: ("matchLabels", "map_str", None)},
    "Deployment": {1: ("metadata", "msg", "ObjectMeta"), 2: ("spec", "msg", "DeploymentSpec")},
    "DeploymentSpec": {1: ("replicas", "int", None), 2: ("selector", "msg", "LabelSelector"),
                       3: ("template", "msg", "PodTemplateSpec"),
                       4: ("strategy", "msg", "DeploymentStrategy")},
    "DeploymentStrategy": {1: ("type", "str", None)},
    "Job": {1: ("metadata", "msg", "ObjectMeta"), 2: ("spec", "msg", "JobSpec")},
    "JobSpec": {1: ("parallelism", "int", None), 2: ("completions", "int", None),
                3: ("activeDeadlineSeconds", "int", None),
                4: ("selector", "msg", "LabelSelector"), 6: ("template", "msg", "PodTemplateSpec"),
                7: ("backoffLimit", "int", None), 10: ("suspend", "bool", None)},
    "PodTemplateSpec": {1: ("metadata", "msg", "ObjectMeta"), 2: ("spec", "msg", "PodSpec")},
    "PodSpec": {2: ("containers", "rep_msg", "Container"), 3: ("restartPolicy", "str", None),
                4: ("terminationGracePeriodSeconds", "int", None),
                7: ("nodeSelector", "map_str", None), 8: ("serviceAccountName", "str", None),
                10: ("nodeName", "str", None), 16: ("hostname", "str", None),
                17: ("subdomain", "str", None), 20: ("initContainers", "rep_msg", "Container"),
                24: ("priorityClassName", "str", None)},
    "Container": {1: ("name", "str", None), 2: ("image", "str", None),
                  3: ("command", "rep_str", None), 4: ("args", "rep_str", None),
                  5: ("workingDir", "str", None), 6: ("ports", "rep_msg", "ContainerPort"),
                  7: ("env", "rep_msg", "EnvVar"), 8: ("resources", "msg", "Resources"),
                  14: ("imagePullPolicy", "str", None)},
    "ContainerPort": {1: ("name", "str", None), 3: ("containerPort", "int", None),
                      4: ("protocol", "str", None)},
    "EnvVar": {1: ("name", "str", None), 2: ("value", "str", None)},
    "Resources": {1: ("limits", "map_quantity", None), 2: ("requests", "map_quantity", None)},
    "Quantity": {1: ("string", "str", None)},
    "Eviction": {1: ("metadata", "msg", "ObjectMeta"),
                 2: ("deleteOptions", "msg", "DeleteOptions")},
    "DeleteOptions": {1: ("gracePeriodSeconds", "int", None),
                      2: ("preconditions", "msg", "Preconditions"),
                      4: ("propagationPolicy", "str", None), 5: ("dryRun", "rep_str", None)},
    "Preconditions": {1: ("uid", "str", None), 2: ("resourceVersion", "str", None)},
    # k8s.io/api/authentication/v1: `kubectl create token`.
    "TokenRequest": {1: ("metadata", "msg", "ObjectMeta"), 2: ("spec", "msg", "TokenRequestSpec")},
    "TokenRequestSpec": {1: ("audiences", "rep_str", None),
                         3: ("boundObjectRef", "msg", "BoundObjectReference"),
                         4: ("expirationSeconds", "int", None)},
    "BoundObjectReference": {1: ("kind", "str", None), 2: ("apiVersion", "str", None),
                             3: ("name", "str", None), 4: ("uid", "str", None)},
    # k8s.io/api/authorization/v1: `kubectl auth can-i`.
    "SelfSubjectAccessReview": {1: ("metadata", "msg", "ObjectMeta"),
                                2: ("spec", "msg", "SelfSubjectAccessReviewSpec")},
    "SelfSubjectAccessReviewSpec": {1: ("resourceAttributes", "msg", "ResourceAttributes"),
                                    2: ("nonResourceAttributes", "msg",
                                        "NonResourceAttributes")},
    "ResourceAttributes": {1: ("namespace", "str", None), 2: ("verb", "str", None),
                           3: ("group", "str", None), 4: ("version", "str", None),
                           5: ("resource", "str", None), 6: ("subresource", "str", None),
                           7: ("name", "str", None)},
    "NonResourceAttributes": {1: ("path", "str", None), 2: ("verb", "str", None)},
}
# Pointer fields in Go: a zero value there was set on purpose and must be kept.
_KEEP_ZERO = {"replicas", "parallelism", "completions", "backoffLimit",
              "terminationGracePeriodSeconds", "gracePeriodSeconds"}


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(data: bytes) -> list[tuple[int, int, Any]]:
    out, pos = [], 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        out.append((number, wire, value))
    return out


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _map_entry(raw: bytes) -> tuple[str, bytes]:
    key, value = "", b""
    for number, _, v in _fields(raw):
        if number == 1:
            key = v.decode()
        elif number == 2:
            value = v
    return key, value


def decode_message(name: str, data: bytes) -> dict[str, Any]:
    import base64

    spec = MESSAGES[name]
    out: dict[str, Any] = {}
    for number, _, value in _fields(data):
        if number not in spec:
            continue
        field, kind, nested = spec[number]
        if kind == "str":
            out[field] = value.decode()
        elif kind == "int":
            out[field] = _signed(value)
        elif kind == "bool":
            out[field] = bool(value)
        elif kind == "msg":
            out[field] = decode_message(nested or "", value)
        elif kind == "rep_str":
            out.setdefault(field, []).append(value.decode())
        elif kind == "rep_msg":
            out.setdefault(field, []).append(decode_message(nested or "", value))
        elif kind == "map_str":
            k, v = _map_entry(value)
            out.setdefault(field, {})[k] = v.decode()
        elif kind == "map_bytes":
            k, v = _map_entry(value)
            out.setdefault(field, {})[k] = base64.b64encode(v).decode()
        elif kind == "map_quantity":
            k, v = _map_entry(value)
            out.setdefault(field, {})[k] = decode_message("Quantity", v).get("string", "")
    return {k: v for k, v in out.items()
            if k in _KEEP_ZERO or v not in ("", 0, False, {}, [])}


def decode(raw: bytes) -> dict[str, Any]:
    """A protobuf-encoded object (`k8s\\0` + runtime.Unknown) as a JSON-style dict."""
    try:
        if not raw.startswith(MAGIC):
            raise ValueError("missing k8s protobuf magic")
        api_version = kind = ""
        body = b""
        for number, _, value in _fields(raw[len(MAGIC):]):
            if number == 1:
                for n, _, v in _fields(value):
                    if n == 1:
                        api_version = v.decode()
                    elif n == 2:
                        kind = v.decode()
            elif number == 2:
                body = value
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "BadRequest", f"error decoding protobuf body: {exc}") from exc
    if kind not in MESSAGES:
        raise ApiError(415, "UnsupportedMediaType",
                       "the body of the request was in an unknown format - accepted media types "
                       "include: application/json, application/yaml")
    obj = decode_message(kind, body)
    return {"apiVersion": api_version, "kind": kind, **obj}
