"""CustomResourceDefinitions: checking them, and turning them into served resource types."""

from __future__ import annotations

from typing import Any

from .errors import FieldCause, cause_invalid, cause_required
from .meta import now_rfc3339
from .resources import ResourceType, ScaleSpec

CLEANUP_FINALIZER = "customresourcecleanup.apiextensions.k8s.io"


def crd_errors(crd: dict[str, Any]) -> list[FieldCause]:
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    errors = []
    group, plural = spec.get("group"), names.get("plural")
    if not group:
        errors.append(cause_required("spec.group"))
    if not plural:
        errors.append(cause_required("spec.names.plural"))
    if not names.get("kind"):
        errors.append(cause_required("spec.names.kind"))
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        errors.append(FieldCause("spec.scope", "FieldValueNotSupported",
                                 f'Unsupported value: "{spec.get("scope", "")}": supported '
                                 'values: "Cluster", "Namespaced"'))
    name = crd.get("metadata", {}).get("name")
    if group and plural and name != f"{plural}.{group}":
        errors.append(cause_invalid("metadata.name", name,
                                    'must be spec.names.plural+"."+spec.group'))
    versions = spec.get("versions") or []
    if not versions:
        errors.append(cause_required("spec.versions", "must have exactly one version marked "
                                     "as storage version"))
    elif sum(1 for v in versions if v.get("storage")) != 1:
        errors.append(cause_invalid("spec.versions", versions,
                                    "must have exactly one version marked as storage version"))
    for i, v in enumerate(versions):
        schema = (v.get("schema") or {}).get("openAPIV3Schema")
        if schema is None:
            errors.append(cause_required(f"spec.versions[{i}].schema.openAPIV3Schema",
                                         "schemas are required"))
    return errors


def set_status(crd: dict[str, Any]) -> None:
    """Accept the names and mark the CRD Established at once (the real server takes ~1s)."""
    spec = crd["spec"]
    now = now_rfc3339()
    crd["status"] = {
        "acceptedNames": dict(spec["names"]),
        "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
             "message": "no conflicts found", "lastTransitionTime": now},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
             "message": "the initial names have been accepted", "lastTransitionTime": now},
        ],
        "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
    }
    names = crd["status"]["acceptedNames"]
    names.setdefault("singular", names["kind"].lower())
    names.setdefault("listKind", names["kind"] + "List")


def default_crd(crd: dict[str, Any]) -> None:
    names = crd.setdefault("spec", {}).setdefault("names", {})
    if names.get("kind"):
        names.setdefault("singular", names["kind"].lower())
        names.setdefault("listKind", names["kind"] + "List")
    crd["spec"].setdefault("conversion", {"strategy": "None"})
    for v in crd["spec"].get("versions") or []:
        v.setdefault("served", True)


def resource_types(crd: dict[str, Any]) -> list[ResourceType]:
    spec = crd["spec"]
    names = spec["names"]
    out = []
    for v in spec.get("versions") or []:
        if not v.get("served", True):
            continue
        sub = v.get("subresources") or {}
        scale = None
        if "scale" in sub:
            s = sub["scale"] or {}
            scale = ScaleSpec(s.get("specReplicasPath", ".spec.replicas"),
                              s.get("statusReplicasPath", ".status.replicas"),
                              s.get("labelSelectorPath"))
        out.append(ResourceType(
            group=spec["group"], version=v["name"], plural=names["plural"], kind=names["kind"],
            namespaced=spec.get("scope") == "Namespaced",
            short_names=list(names.get("shortNames") or []),
            singular=names.get("singular") or names["kind"].lower(),
            categories=list(names.get("categories") or []),
            status_subresource="status" in sub, scale=scale, crd=crd, builtin=False,
            field_labels=tuple(f["jsonPath"].lstrip(".")
                               for f in v.get("selectableFields") or []),
        ))
    return out
