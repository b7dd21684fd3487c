"""The autoscaling/v1 Scale subresource, mapped onto a kind's replica paths."""

from __future__ import annotations

import copy
from typing import Any

from . import patch
from .core import Core
from .errors import bad_request, cause_invalid, invalid
from .resources import ResourceType
from .selectors import selector_to_string


def _get_path(obj: dict[str, Any], path: str) -> Any:
    cur: Any = obj
    for part in path.lstrip(".").split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    parts = path.lstrip(".").split(".")
    cur = obj
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
    cur[parts[-1]] = value


def scale_get(rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
    assert rt.scale is not None
    meta = obj["metadata"]
    selector: Any = None
    if rt.scale.label_selector_path:
        selector = _get_path(obj, rt.scale.label_selector_path)
        if isinstance(selector, dict):
            selector = selector_to_string(selector)
    status: dict[str, Any] = {"replicas": _get_path(obj, rt.scale.status_replicas_path) or 0}
    if selector:
        status["selector"] = selector
    spec: dict[str, Any] = {}
    replicas = _get_path(obj, rt.scale.spec_replicas_path)
    if replicas is not None:
        spec["replicas"] = replicas
    scale_meta = {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                       "creationTimestamp") if k in meta}
    return {"kind": "Scale", "apiVersion": "autoscaling/v1", "metadata": scale_meta,
            "spec": spec, "status": status}


def scale_update(core: Core, rt: ResourceType, ns: str, name: str, body: Any,
                 content_type: str | None, dry_run: bool) -> dict[str, Any]:
    """PUT or PATCH a Scale; the replica count lands in the object, which is re-validated."""
    assert rt.scale is not None
    obj = core.get(rt, ns, name)
    current = scale_get(rt, obj)
    if content_type is None:
        new_scale = body
    else:
        new_scale = patch.apply_patch(copy.deepcopy(current), body, content_type, True)
    if not isinstance(new_scale, dict):
        raise bad_request("the body of the request was not a Scale object")
    if not isinstance(new_scale.get("spec") or {}, dict) or not isinstance(
            new_scale.get("metadata") or {}, dict):
        raise bad_request("the body of the request was not a Scale object")
    rv = (new_scale.get("metadata") or {}).get("resourceVersion")
    replicas = (new_scale.get("spec") or {}).get("replicas")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise invalid("Scale", "autoscaling", name, [cause_invalid(
            "spec.replicas", replicas, "must be greater than or equal to 0")])
    updated = copy.deepcopy(obj)
    _set_path(updated, rt.scale.spec_replicas_path, replicas)
    updated["metadata"]["resourceVersion"] = rv or obj["metadata"]["resourceVersion"]
    result = core.update(rt, ns, name, updated, dry_run=dry_run, current=obj)
    return scale_get(rt, result)
