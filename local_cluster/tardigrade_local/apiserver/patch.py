"""The four patch types: JSON merge, JSON patch, strategic merge, and server-side apply."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import yaml

from . import decoding
from .errors import ApiError, bad_request

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"
APPLY_CBOR = "application/apply-patch+cbor"
PATCH_TYPES = (MERGE, JSON_PATCH, STRATEGIC, APPLY)

# Patch merge keys of built-in kinds, by list field name (the Go structs' patchMergeKey tags).
# Lists not named here are replaced wholesale, as in the real server.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "conditions": "type",
    "ownerReferences": "uid",
    "hostAliases": "ip",
    "taints": "key",
    "addresses": "type",
    "topologySpreadConstraints": "topologyKey",
    "resourceClaims": "name",
}
# Primitive lists whose patch strategy is "merge" (union) instead of replace.
_MERGED_PRIMITIVE_LISTS = {"finalizers"}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch; returns a new value, leaving both inputs alone."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    _merge_into(result, patch)
    return result


def _merge_into(result: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            current = result.get(key)
            if not isinstance(current, dict):
                current = result[key] = {}
            _merge_into(current, value)
        else:
            result[key] = copy.deepcopy(value)


def json_patch(target: dict[str, Any], ops: Any) -> dict[str, Any]:
    if not isinstance(ops, list):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    try:
        return jsonpatch.JsonPatch(ops).apply(target)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, KeyError,
            IndexError, TypeError) as exc:
        # kopf relies on a failed `test` being 422 Invalid (not 500): it re-reads and retries.
        raise _rejected(str(exc)) from exc


def _rejected(server_message: str) -> ApiError:
    """The real server's NewGenericServerResponse(422, ...): the patch error is not shown."""
    del server_message
    return ApiError(422, "Invalid", "the server rejected our request due to an error in our "
                    "request", {})


def _merge_key(field: str, parent: str) -> str | None:
    if field == "ports":
        return "containerPort" if parent in ("containers", "initContainers",
                                             "ephemeralContainers") else "port"
    return _MERGE_KEYS.get(field)


def strategic_merge(target: Any, patch: Any, parent: str = "") -> Any:
    """Strategic merge patch for built-in kinds, with the directives kubectl sends."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [v for v in result.get(field) or [] if v not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _merge_list(result.get(key), value, key, parent)
        elif isinstance(value, dict):
            merged = strategic_merge(result.get(key), value, key)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = value
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_list(current: Any, patch: list[Any], field: str, parent: str) -> list[Any]:
    current = current if isinstance(current, list) else []
    if field in _MERGED_PRIMITIVE_LISTS:
        out = list(current)
        out += [v for v in patch if v not in out]
        return out
    key = _merge_key(field, parent)
    if key is None or not all(isinstance(v, dict) for v in patch):
        return [copy.deepcopy(v) for v in patch if not (isinstance(v, dict) and "$patch" in v)]
    if any(isinstance(v, dict) and v.get("$patch") == "replace" for v in patch):
        return [copy.deepcopy(v) for v in patch if v.get("$patch") != "replace"]
    out = copy.deepcopy(current)
    for item in patch:
        idx = next((i for i, cur in enumerate(out)
                    if isinstance(cur, dict) and cur.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if idx is not None:
                out.pop(idx)
        elif idx is None:
            out.append(strategic_merge({}, item, field))
        else:
            out[idx] = strategic_merge(out[idx], item, field)
    return out


def parse_body(raw: bytes, content_type: str) -> Any:
    """Decode a request body (JSON, or YAML for apply patches and YAML uploads)."""
    try:
        if "yaml" in content_type:
            return decoding.decode_yaml(raw)
        return decoding.decode_json(raw)
    except (ValueError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise bad_request(_decode_error(exc)) from exc


def _decode_error(exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        # The real server reports Go's decoder message; this is the closest equivalent.
        return (f"error decoding from json: invalid character at line {exc.lineno} "
                f"column {exc.colno}: {exc.msg}")
    return f"error converting YAML to JSON: {exc}"


def apply_patch(current: dict[str, Any], patch: Any, content_type: str,
                builtin: bool) -> dict[str, Any]:
    base = content_type.split(";")[0].strip()
    if base == MERGE:
        if not isinstance(patch, dict):
            raise bad_request("json: cannot unmarshal array into Go value of type map[string]"
                              "interface {}")
        return merge_patch(current, patch)
    if base == JSON_PATCH:
        return json_patch(current, patch)
    if base == STRATEGIC:
        if not builtin:
            raise ApiError(415, "UnsupportedMediaType",
                           "the body of the request was in an unknown format - accepted media "
                           "types include: application/json-patch+json, "
                           "application/merge-patch+json, application/apply-patch+yaml")
        if not isinstance(patch, dict):
            raise bad_request("json: cannot unmarshal array into Go value of type map[string]"
                              "interface {}")
        return strategic_merge(current, patch)
    if base == APPLY:
        if not isinstance(patch, dict):
            raise bad_request("error decoding YAML: the applied configuration is not an object")
        # Whole-object server-side apply: the applied configuration wins field by field.
        return strategic_merge(current, patch) if builtin else merge_patch(current, patch)
    raise ApiError(415, "UnsupportedMediaType",
                   f"the body of the request was in an unknown format - accepted media types "
                   f"include: {', '.join(PATCH_TYPES)}")
