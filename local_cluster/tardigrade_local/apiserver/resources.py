"""The kinds this server knows: built-in ones, plus CRD-defined ones registered at runtime."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ALL_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


@dataclass
class ScaleSpec:
    """Where a kind keeps the numbers that its autoscaling/v1 Scale subresource exposes."""

    spec_replicas_path: str = ".spec.replicas"
    status_replicas_path: str = ".status.replicas"
    label_selector_path: str | None = None


@dataclass
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    short_names: list[str] = field(default_factory=list)
    singular: str = ""
    categories: list[str] = field(default_factory=list)
    verbs: list[str] = field(default_factory=lambda: list(ALL_VERBS))
    status_subresource: bool = False
    scale: ScaleSpec | None = None
    # Extra subresources (name -> (kind, group, version, verbs)), e.g. pods/eviction.
    extra_subresources: dict[str, tuple[str, str, str, list[str]]] = field(default_factory=dict)
    # Set for custom resources: the CRD and the version entry that describes this kind.
    crd: dict[str, Any] | None = None
    builtin: bool = True
    # Field selectors the kind supports beyond metadata.name/namespace.
    field_labels: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        """Storage key: one store per group/plural, whatever the version."""
        return f"{self.group}/{self.plural}"

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"


def _rt(group: str, version: str, plural: str, kind: str, namespaced: bool,
        short: list[str] | None = None, **kw: Any) -> ResourceType:
    return ResourceType(group, version, plural, kind, namespaced, short or [],
                        singular=kind.lower(), **kw)


_POD_FIELDS = ("spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
               "spec.serviceAccountName", "spec.hostNetwork", "status.phase", "status.podIP",
               "status.nominatedNodeName")
_EVENT_FIELDS = ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                 "involvedObject.uid", "involvedObject.apiVersion",
                 "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason",
                 "reportingComponent", "source", "type")


def builtin_types() -> list[ResourceType]:
    return [
        _rt("", "v1", "namespaces", "Namespace", False, ["ns"], status_subresource=True,
            verbs=["create", "delete", "get", "list", "patch", "update", "watch"],
            field_labels=("status.phase",)),
        _rt("", "v1", "pods", "Pod", True, ["po"], status_subresource=True,
            categories=["all"], field_labels=_POD_FIELDS,
            extra_subresources={
                "eviction": ("Eviction", "policy", "v1", ["create"]),
                "binding": ("Binding", "", "v1", ["create"]),
                "log": ("Pod", "", "v1", ["get"]),
            }),
        _rt("", "v1", "services", "Service", True, ["svc"], status_subresource=True,
            categories=["all"], verbs=[v for v in ALL_VERBS]),
        _rt("", "v1", "endpoints", "Endpoints", True, ["ep"]),
        _rt("", "v1", "events", "Event", True, ["ev"], field_labels=_EVENT_FIELDS),
        _rt("", "v1", "nodes", "Node", False, ["no"], status_subresource=True,
            field_labels=("spec.unschedulable",)),
        _rt("", "v1", "configmaps", "ConfigMap", True, ["cm"]),
        _rt("", "v1", "secrets", "Secret", True, [], field_labels=("type",)),
        _rt("", "v1", "serviceaccounts", "ServiceAccount", True, ["sa"],
            extra_subresources={
                "token": ("TokenRequest", "authentication.k8s.io", "v1", ["create"]),
            }),
        _rt("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, ["pvc"],
            status_subresource=True),
        _rt("apps", "v1", "deployments", "Deployment", True, ["deploy"], status_subresource=True,
            categories=["all"], scale=ScaleSpec(label_selector_path=".spec.selector")),
        _rt("apps", "v1", "statefulsets", "StatefulSet", True, ["sts"], status_subresource=True,
            categories=["all"], scale=ScaleSpec(label_selector_path=".spec.selector")),
        _rt("apps", "v1", "replicasets", "ReplicaSet", True, ["rs"], status_subresource=True,
            categories=["all"], scale=ScaleSpec(label_selector_path=".spec.selector")),
        _rt("batch", "v1", "jobs", "Job", True, [], status_subresource=True, categories=["all"]),
        _rt("coordination.k8s.io", "v1", "leases", "Lease", True),
        _rt("events.k8s.io", "v1", "events", "Event", True, ["ev"]),
        _rt("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, ["pdb"],
            status_subresource=True),
        _rt("rbac.authorization.k8s.io", "v1", "roles", "Role", True),
        _rt("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True),
        _rt("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False),
        _rt("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding",
            False),
        _rt("scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", False, ["pc"]),
        # Answered, never stored (review.py).
        _rt("authorization.k8s.io", "v1", "selfsubjectaccessreviews",
            "SelfSubjectAccessReview", False, verbs=["create"]),
        _rt("authentication.k8s.io", "v1", "tokenreviews", "TokenReview", False,
            verbs=["create"]),
        _rt("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True, ["netpol"]),
        _rt("apiextensions.k8s.io", "v1", "customresourcedefinitions",
            "CustomResourceDefinition", False, ["crd", "crds"], status_subresource=True),
    ]


# Preferred order of groups in discovery, like the real server (core first).
GROUP_ORDER = ["", "apps", "events.k8s.io", "authentication.k8s.io", "authorization.k8s.io",
               "batch", "networking.k8s.io", "policy", "rbac.authorization.k8s.io",
               "coordination.k8s.io", "scheduling.k8s.io", "apiextensions.k8s.io"]


class Registry:
    """Lookup of resource types by group/version/plural, kind, and short name."""

    def __init__(self) -> None:
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        for rt in builtin_types():
            self.add(rt)

    def add(self, rt: ResourceType) -> None:
        self._types[(rt.group, rt.version, rt.plural)] = rt

    def remove_group_plural(self, group: str, plural: str) -> None:
        for key in [k for k in self._types if k[0] == group and k[2] == plural]:
            del self._types[key]

    def get(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self._types.get((group, version, plural))

    def all(self) -> list[ResourceType]:
        return list(self._types.values())

    def group_versions(self) -> dict[str, list[str]]:
        """group -> served versions (preferred first)."""
        out: dict[str, list[str]] = {}
        for rt in self._types.values():
            versions = out.setdefault(rt.group, [])
            if rt.version not in versions:
                versions.append(rt.version)
        for group, versions in out.items():
            out[group] = sorted(versions, key=_version_priority)
        return out

    def in_group_version(self, group: str, version: str) -> list[ResourceType]:
        return [rt for rt in self._types.values() if rt.group == group and rt.version == version]

    def by_kind(self, api_version: str, kind: str) -> ResourceType | None:
        group, _, version = api_version.rpartition("/")
        for rt in self._types.values():
            if rt.group == group and rt.version == version and rt.kind == kind:
                return rt
        return None


def _version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes version order: GA > beta > alpha, higher numbers first."""
    import re

    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not m:
        return (3, 0, 0)
    major = int(m.group(1))
    stage = {"alpha": 2, "beta": 1}.get(m.group(2) or "", 0)
    minor = int(m.group(3) or 0)
    return (stage, -major, -minor)
