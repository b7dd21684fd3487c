"""Discovery documents: /version, /api, /apis and per group-version resource lists."""

from __future__ import annotations

from typing import Any

from .resources import GROUP_ORDER, Registry, ResourceType

# The Kubernetes release this server imitates; clients compare it for feature detection.
VERSION_INFO = {
    "major": "1",
    "minor": "33",
    "gitVersion": "v1.33.0-tardigrade",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.24.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}


def api_versions() -> dict[str, Any]:
    return {"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0",
                                            "serverAddress": "127.0.0.1"}]}


def _group_entry(group: str, versions: list[str]) -> dict[str, Any]:
    gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {"name": group, "versions": gvs, "preferredVersion": gvs[0]}


def _ordered_groups(registry: Registry) -> list[tuple[str, list[str]]]:
    gv = registry.group_versions()
    known = [g for g in GROUP_ORDER if g in gv]
    custom = sorted(g for g in gv if g not in GROUP_ORDER)
    return [(g, gv[g]) for g in known + custom]


def api_group_list(registry: Registry) -> dict[str, Any]:
    return {"kind": "APIGroupList", "apiVersion": "v1",
            "groups": [_group_entry(g, vs) for g, vs in _ordered_groups(registry) if g]}


def api_group(registry: Registry, group: str) -> dict[str, Any] | None:
    versions = registry.group_versions().get(group)
    if not versions:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group_entry(group, versions)}


def _entries(rt: ResourceType) -> list[dict[str, Any]]:
    main: dict[str, Any] = {
        "name": rt.plural, "singularName": rt.singular, "namespaced": rt.namespaced,
        "kind": rt.kind, "verbs": rt.verbs,
    }
    if rt.short_names:
        main["shortNames"] = rt.short_names
    if rt.categories:
        main["categories"] = rt.categories
    out = [main]
    if rt.status_subresource:
        out.append({"name": f"{rt.plural}/status", "singularName": "", "namespaced":
                    rt.namespaced, "kind": rt.kind, "verbs": ["get", "patch", "update"]})
    if rt.scale is not None:
        out.append({"name": f"{rt.plural}/scale", "singularName": "", "namespaced":
                    rt.namespaced, "group": "autoscaling", "version": "v1", "kind": "Scale",
                    "verbs": ["get", "patch", "update"]})
    for sub, (kind, group, version, verbs) in rt.extra_subresources.items():
        entry: dict[str, Any] = {"name": f"{rt.plural}/{sub}", "singularName": "",
                                 "namespaced": rt.namespaced, "kind": kind, "verbs": verbs}
        if group:
            entry["group"] = group
            entry["version"] = version
        out.append(entry)
    return out


def resource_list(registry: Registry, group: str, version: str) -> dict[str, Any] | None:
    types = registry.in_group_version(group, version)
    if not types:
        return None
    resources = [e for rt in sorted(types, key=lambda r: r.plural) for e in _entries(rt)]
    return {"kind": "APIResourceList", "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version, "resources": resources}


# ---- aggregated discovery (apidiscovery.k8s.io/v2): one request instead of one per GV ----
AGGREGATED_V2 = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"


def wants_aggregated(accept: str) -> bool:
    first = accept.split(",")[0].replace(" ", "")
    return "g=apidiscovery.k8s.io" in first and "v=v2" in first and "v=v2beta1" not in first


def _kind_ref(group: str, version: str, kind: str) -> dict[str, str]:
    return {"group": group, "version": version, "kind": kind}


def _aggregated_resource(rt: ResourceType) -> dict[str, Any]:
    out: dict[str, Any] = {
        "resource": rt.plural,
        "responseKind": _kind_ref(rt.group, rt.version, rt.kind),
        "scope": "Namespaced" if rt.namespaced else "Cluster",
        "singularResource": rt.singular,
        "verbs": rt.verbs,
    }
    if rt.short_names:
        out["shortNames"] = rt.short_names
    if rt.categories:
        out["categories"] = rt.categories
    subs = []
    if rt.status_subresource:
        subs.append({"subresource": "status",
                     "responseKind": _kind_ref(rt.group, rt.version, rt.kind),
                     "verbs": ["get", "patch", "update"]})
    if rt.scale is not None:
        subs.append({"subresource": "scale",
                     "responseKind": _kind_ref("autoscaling", "v1", "Scale"),
                     "verbs": ["get", "patch", "update"]})
    for sub, (kind, group, version, verbs) in rt.extra_subresources.items():
        subs.append({"subresource": sub, "responseKind": _kind_ref(group, version, kind),
                     "verbs": verbs})
    if subs:
        out["subresources"] = subs
    return out


def aggregated(registry: Registry, core: bool) -> dict[str, Any]:
    items = []
    for group, versions in _ordered_groups(registry):
        if (group == "") != core:
            continue
        entries = []
        for version in versions:
            types = sorted(registry.in_group_version(group, version), key=lambda r: r.plural)
            entries.append({"version": version, "freshness": "Current",
                            "resources": [_aggregated_resource(rt) for rt in types]})
        meta: dict[str, Any] = {"creationTimestamp": None}
        if group:
            meta["name"] = group
        items.append({"metadata": meta, "versions": entries})
    return {"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2",
            "metadata": {}, "items": items}
