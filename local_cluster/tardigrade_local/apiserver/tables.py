"""`meta.k8s.io/v1` Table answers, which is what `kubectl get` prints.

Custom resources get the columns of their CRD's additionalPrinterColumns (evaluated with
jsonpath-ng), built-in kinds get the columns the real server prints for them.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

from jsonpath_ng.exceptions import JsonPathParserError
from jsonpath_ng.ext import parse as jsonpath_parse

from .meta import age
from .resources import ResourceType

NAME_COLUMN = {"name": "Name", "type": "string", "format": "name", "priority": 0,
               "description": "Name must be unique within a namespace. Is required when "
                              "creating resources, although some resources may allow a client "
                              "to request the generation of an appropriate name automatically. "
                              "Name is primarily intended for creation idempotence and "
                              "configuration definition. Cannot be updated. More info: "
                              "https://kubernetes.io/docs/concepts/overview/working-with-"
                              "objects/names#names"}


def _col(name: str, type_: str = "string", priority: int = 0, description: str = "") -> dict[
        str, Any]:
    return {"name": name, "type": type_, "format": "", "description": description or name,
            "priority": priority}


AGE = _col("Age", description="CreationTimestamp is a timestamp representing the server time "
                              "when this object was created.")


def wants_table(accept: str) -> bool:
    return "as=Table" in accept


# ---- custom resources ---------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _compiled(path: str) -> Any:
    # Kubernetes JSONPath is `{.spec.x}` or `.spec.x`; jsonpath-ng wants `$.spec.x`.
    expr = path.strip()
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    if expr.startswith("."):
        expr = "$" + expr
    expr = re.sub(r'==\s*"([^"]*)"', r"=='\1'", expr)
    return jsonpath_parse(expr)


def _jsonpath_value(obj: dict[str, Any], path: str) -> Any:
    try:
        matches = _compiled(path).find(obj)
    except (JsonPathParserError, Exception):
        return None
    return matches[0].value if matches else None


def _cell(type_: str, value: Any) -> Any:
    if value is None:
        return None
    if type_ == "date":
        return age(value) if isinstance(value, str) else None
    if type_ == "integer":
        return value if isinstance(value, int) else None
    if type_ == "number":
        return value if isinstance(value, int | float) else None
    if type_ == "boolean":
        return value if isinstance(value, bool) else None
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))


def _crd_columns(rt: ResourceType) -> list[dict[str, Any]]:
    assert rt.crd is not None
    version = next((v for v in rt.crd["spec"].get("versions") or []
                    if v.get("name") == rt.version), {})
    cols = version.get("additionalPrinterColumns")
    if cols is None:
        return [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    return cols


def _custom_table(rt: ResourceType) -> tuple[list[dict[str, Any]],
                                             Callable[[dict[str, Any]], list[Any]]]:
    cols = _crd_columns(rt)
    definitions = [NAME_COLUMN] + [
        {"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
         "description": c.get("description") or
         f"Custom resource definition column (in JSONPath format): {c['jsonPath']}",
         "priority": c.get("priority", 0)} for c in cols]

    def row(obj: dict[str, Any]) -> list[Any]:
        return [obj["metadata"]["name"]] + [
            _cell(c.get("type", "string"), _jsonpath_value(obj, c["jsonPath"])) for c in cols]

    return definitions, row


# ---- built-in kinds -----------------------------------------------------------------------
def _pod_row(pod: dict[str, Any]) -> list[Any]:
    spec, status = pod.get("spec", {}), pod.get("status", {})
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for s in statuses if s.get("ready"))
    restarts = sum(int(s.get("restartCount", 0)) for s in statuses)
    reason = status.get("reason") or status.get("phase") or "Unknown"
    for s in statuses:
        state = s.get("state") or {}
        if state.get("waiting", {}).get("reason"):
            reason = state["waiting"]["reason"]
        elif state.get("terminated"):
            term = state["terminated"]
            reason = term.get("reason") or (f"Signal:{term['signal']}" if term.get("signal")
                                            else f"ExitCode:{term.get('exitCode')}")
    if pod["metadata"].get("deletionTimestamp"):
        reason = "Terminating"
    gates = spec.get("readinessGates") or []
    return [pod["metadata"]["name"], f"{ready}/{len(spec.get('containers') or [])}", reason,
            restarts, age(pod["metadata"].get("creationTimestamp")),
            status.get("podIP") or "<none>", spec.get("nodeName") or "<none>",
            status.get("nominatedNodeName") or "<none>",
            f"{len(gates)}" if gates else "<none>"]


def _node_row(node: dict[str, Any]) -> list[Any]:
    conds = {c.get("type"): c.get("status")
             for c in node.get("status", {}).get("conditions") or []}
    state = {"True": "Ready", "False": "NotReady"}.get(conds.get("Ready", ""), "Unknown")
    if node.get("spec", {}).get("unschedulable"):
        state += ",SchedulingDisabled"
    labels = node["metadata"].get("labels") or {}
    roles = sorted(k.split("/", 1)[1] for k in labels
                   if k.startswith("node-role.kubernetes.io/"))
    info = node.get("status", {}).get("nodeInfo") or {}
    addresses = {a.get("type"): a.get("address")
                 for a in node.get("status", {}).get("addresses") or []}
    return [node["metadata"]["name"], state, ",".join(roles) or "<none>",
            age(node["metadata"].get("creationTimestamp")), info.get("kubeletVersion", ""),
            addresses.get("InternalIP", "<none>"), addresses.get("ExternalIP", "<none>"),
            info.get("osImage", "<unknown>"), info.get("kernelVersion", "<unknown>"),
            info.get("containerRuntimeVersion", "<unknown>")]


def _service_row(svc: dict[str, Any]) -> list[Any]:
    spec = svc.get("spec", {})
    ports = ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}"
                     for p in spec.get("ports") or []) or "<none>"
    selector = ",".join(f"{k}={v}" for k, v in sorted((spec.get("selector") or {}).items()))
    return [svc["metadata"]["name"], spec.get("type", "ClusterIP"),
            spec.get("clusterIP") or "<none>", "<none>", ports,
            age(svc["metadata"].get("creationTimestamp")), selector or "<none>"]


def _deployment_row(d: dict[str, Any]) -> list[Any]:
    spec, status = d.get("spec", {}), d.get("status", {})
    return [d["metadata"]["name"], f"{status.get('readyReplicas', 0)}/{spec.get('replicas', 0)}",
            status.get("updatedReplicas", 0), status.get("availableReplicas", 0),
            age(d["metadata"].get("creationTimestamp"))]


def _replicaset_row(rs: dict[str, Any]) -> list[Any]:
    spec, status = rs.get("spec", {}), rs.get("status", {})
    return [rs["metadata"]["name"], spec.get("replicas", 0), status.get("replicas", 0),
            status.get("readyReplicas", 0), age(rs["metadata"].get("creationTimestamp"))]


_BUILTIN: dict[str, tuple[list[dict[str, Any]], Callable[[dict[str, Any]], list[Any]]]] = {
    "Pod": ([NAME_COLUMN, _col("Ready"), _col("Status"), _col("Restarts", "string"), AGE,
             _col("IP", priority=1), _col("Node", priority=1),
             _col("Nominated Node", priority=1), _col("Readiness Gates", priority=1)], _pod_row),
    "Node": ([NAME_COLUMN, _col("Status"), _col("Roles"), AGE, _col("Version"),
              _col("Internal-IP", priority=1), _col("External-IP", priority=1),
              _col("OS-Image", priority=1), _col("Kernel-Version", priority=1),
              _col("Container-Runtime", priority=1)], _node_row),
    "Namespace": ([NAME_COLUMN, _col("Status"), AGE],
                  lambda o: [o["metadata"]["name"], o.get("status", {}).get("phase", ""),
                             age(o["metadata"].get("creationTimestamp"))]),
    "Service": ([NAME_COLUMN, _col("Type"), _col("Cluster-IP"), _col("External-IP"),
                 _col("Port(s)"), AGE, _col("Selector", priority=1)], _service_row),
    "Deployment": ([NAME_COLUMN, _col("Ready"), _col("Up-to-date", "integer"),
                    _col("Available", "integer"), AGE], _deployment_row),
    "ReplicaSet": ([NAME_COLUMN, _col("Desired", "integer"), _col("Current", "integer"),
                    _col("Ready", "integer"), AGE], _replicaset_row),
    "ConfigMap": ([NAME_COLUMN, _col("Data", "integer"), AGE],
                  lambda o: [o["metadata"]["name"],
                             len(o.get("data") or {}) + len(o.get("binaryData") or {}),
                             age(o["metadata"].get("creationTimestamp"))]),
    "Secret": ([NAME_COLUMN, _col("Type"), _col("Data", "integer"), AGE],
               lambda o: [o["metadata"]["name"], o.get("type", ""), len(o.get("data") or {}),
                          age(o["metadata"].get("creationTimestamp"))]),
    "CustomResourceDefinition": ([NAME_COLUMN, _col("Created At", "date")],
                                 lambda o: [o["metadata"]["name"],
                                            o["metadata"].get("creationTimestamp")]),
    "Event": ([_col("Last Seen"), _col("Type"), _col("Reason"), _col("Object"),
               _col("Message")],
              lambda o: [age(o.get("lastTimestamp") or o.get("eventTime")
                             or o["metadata"].get("creationTimestamp")), o.get("type", ""),
                         o.get("reason", ""),
                         f"{(o.get('involvedObject') or {}).get('kind', '').lower()}/"
                         f"{(o.get('involvedObject') or {}).get('name', '')}",
                         o.get("message", o.get("note", ""))]),
}


def _default_row(o: dict[str, Any]) -> list[Any]:
    return [o["metadata"]["name"], age(o["metadata"].get("creationTimestamp"))]


def columns_and_row(rt: ResourceType) -> tuple[list[dict[str, Any]],
                                               Callable[[dict[str, Any]], list[Any]]]:
    if not rt.builtin:
        return _custom_table(rt)
    return _BUILTIN.get(rt.kind, ([NAME_COLUMN, AGE], _default_row))


def _row_object(rt: ResourceType, obj: dict[str, Any], include: str) -> dict[str, Any] | None:
    if include == "None":
        return None
    if include == "Object":
        return obj
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
            "metadata": obj["metadata"]}


def to_table(rt: ResourceType, objs: list[dict[str, Any]], list_meta: dict[str, Any],
             include: str = "Metadata", with_columns: bool = True) -> dict[str, Any]:
    definitions, row = columns_and_row(rt)
    rows = []
    for obj in objs:
        entry: dict[str, Any] = {"cells": row(obj)}
        ref = _row_object(rt, obj, include)
        if ref is not None:
            entry["object"] = ref
        rows.append(entry)
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": list_meta,
            "columnDefinitions": definitions if with_columns else [], "rows": rows}
