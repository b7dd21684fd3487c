"""What the real server does per built-in kind on create/update: defaults and key checks."""

from __future__ import annotations

import itertools
from typing import Any

from .errors import (
    FieldCause,
    cause_duplicate,
    cause_forbidden,
    cause_invalid,
    cause_not_supported,
    cause_required,
)
from .validation import name_errors


def allocate_cluster_ip(used: set[str]) -> str:
    """The first free address of the service range (10.96.0.0/16, .1 is `kubernetes`)."""
    for n in range(2, 65534):
        ip = f"10.96.{n // 256}.{n % 256}"
        if n % 256 not in (0, 255) and ip not in used:
            return ip
    raise RuntimeError("service IP range exhausted")


def _default_container(c: dict[str, Any]) -> None:
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    image = c.get("image", "")
    tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
    c.setdefault("imagePullPolicy", "Always" if tag in ("", "latest") else "IfNotPresent")
    c.setdefault("resources", {})
    for port in c.get("ports") or []:
        port.setdefault("protocol", "TCP")


def _default_pod_spec(spec: dict[str, Any]) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    spec.setdefault("priority", 0)
    if "serviceAccountName" not in spec:
        spec["serviceAccountName"] = spec.get("serviceAccount", "default")
    spec.setdefault("serviceAccount", spec["serviceAccountName"])
    for c in itertools.chain(spec.get("containers") or [], spec.get("initContainers") or []):
        if isinstance(c, dict):
            _default_container(c)


# The DefaultTolerationSeconds admission plugin (on by default, on create and update;
# plugin/pkg/admission/defaulttolerationseconds/admission.go, Admit): a pod that does not
# tolerate these NoExecute taints gets a toleration of 300 s for each
# (--default-not-ready-toleration-seconds, --default-unreachable-toleration-seconds), so taint
# eviction deletes it 5 min after its node went NotReady or unreachable.
DEFAULT_TOLERATION_SECONDS = 300
DEFAULT_TOLERATED_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def _default_toleration_seconds(spec: dict[str, Any]) -> None:
    tolerations = spec.get("tolerations")
    if not isinstance(tolerations, list):
        tolerations = []
    for key in DEFAULT_TOLERATED_TAINTS:
        # Admit: an empty key (with Exists) or effect matches too.
        if any(isinstance(t, dict) and t.get("key", "") in (key, "")
               and t.get("effect", "") in ("NoExecute", "") for t in tolerations):
            continue
        tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute",
                            "tolerationSeconds": DEFAULT_TOLERATION_SECONDS})
    spec["tolerations"] = tolerations


def _qos_class(spec: dict[str, Any]) -> str:
    """Guaranteed, Burstable or BestEffort, from the containers' requests and limits."""
    containers = [c for c in itertools.chain(spec.get("containers") or [],
                                             spec.get("initContainers") or [])
                  if isinstance(c, dict)]
    resources = [c.get("resources") or {} for c in containers]
    if not any(r.get("requests") or r.get("limits") for r in resources):
        return "BestEffort"
    for r in resources:
        limits = r.get("limits") or {}
        requests = {**limits, **(r.get("requests") or {})}
        if not all(k in limits for k in ("cpu", "memory")) or any(
                str(requests.get(k)) != str(limits.get(k)) for k in ("cpu", "memory")):
            return "Burstable"
    return "Guaranteed"


def _default_workload(kind: str, spec: dict[str, Any]) -> None:
    spec.setdefault("replicas", 1)
    if kind != "ReplicaSet":  # a ReplicaSet has no history of its own
        spec.setdefault("revisionHistoryLimit", 10)
    if kind == "Deployment":
        spec.setdefault("progressDeadlineSeconds", 600)
        strategy = spec.setdefault("strategy", {})
        if isinstance(strategy, dict):
            strategy.setdefault("type", "RollingUpdate")
            if strategy["type"] == "RollingUpdate":
                rolling = strategy.setdefault("rollingUpdate", {})
                if isinstance(rolling, dict):
                    rolling.setdefault("maxSurge", "25%")
                    rolling.setdefault("maxUnavailable", "25%")
    template = spec.get("template") or {}
    if isinstance(template.get("spec"), dict):
        _default_pod_spec(template["spec"])


def default_on_create(kind: str, obj: dict[str, Any], used_ips: set[str] | None = None) -> None:
    used_ips = used_ips or set()
    spec = obj.get("spec")
    if kind == "Pod":
        spec = obj.setdefault("spec", {})
        _default_pod_spec(spec)
        _default_toleration_seconds(spec)
        # A new pod is Pending until a kubelet says otherwise.
        obj["status"] = {"phase": "Pending", "qosClass": _qos_class(spec)}
    elif kind == "Service":
        spec = obj.setdefault("spec", {})
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        spec.setdefault("internalTrafficPolicy", "Cluster")
        if "clusterIP" not in spec:
            spec["clusterIP"] = allocate_cluster_ip(used_ips)
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
        obj["status"] = {"loadBalancer": {}}
    elif kind == "Namespace":
        obj["spec"] = {"finalizers": ["kubernetes"]}
        obj["status"] = {"phase": "Active"}
        obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = (
            obj["metadata"]["name"])
    elif kind in ("Deployment", "StatefulSet", "ReplicaSet") and isinstance(spec, dict):
        _default_workload(kind, spec)
        obj["status"] = {}
    elif kind == "Job" and isinstance(spec, dict):
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("completions", 1)
        spec.setdefault("parallelism", 1)
        obj["status"] = {}
    elif kind == "Secret":
        obj.setdefault("type", "Opaque")
        _fold_string_data(obj)


def default_on_update(kind: str, obj: dict[str, Any], old: dict[str, Any]) -> None:
    """Defaults apply to every write (the real server defaults on decode), so a PUT of the
    original manifest compares equal to what the create stored."""
    spec = obj.get("spec")
    if kind == "Secret":
        _fold_string_data(obj)
    elif kind == "Pod" and isinstance(spec, dict):
        _default_pod_spec(spec)
        _default_toleration_seconds(spec)  # the plugin admits updates too
    elif kind == "Service" and isinstance(spec, dict):
        old_spec = old.get("spec") or {}
        spec.setdefault("type", old_spec.get("type", "ClusterIP"))
        for key in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy",
                    "sessionAffinity", "internalTrafficPolicy"):
            if key not in spec and key in old_spec:
                spec[key] = old_spec[key]
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
    elif kind in ("Deployment", "StatefulSet", "ReplicaSet") and isinstance(spec, dict):
        _default_workload(kind, spec)
    elif kind == "Namespace":
        obj.setdefault("metadata", {}).setdefault("labels", {})[
            "kubernetes.io/metadata.name"] = obj["metadata"]["name"]


def _fold_string_data(secret: dict[str, Any]) -> None:
    """stringData is write-only: the server base64-encodes it into data."""
    import base64

    string_data = secret.pop("stringData", None) or {}
    if string_data:
        data = secret.setdefault("data", {})
        for key, value in string_data.items():
            data[key] = base64.b64encode(str(value).encode()).decode()


def validate(kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> list[FieldCause]:
    errors: list[FieldCause] = []
    spec = obj.get("spec") or {}
    if kind == "Pod":
        errors += pod_spec_errors(spec, "spec")
        if old is not None:
            errors += _pod_update_errors(obj, old)
    elif kind == "Service":
        for i, port in enumerate(spec.get("ports") or []):
            if not isinstance(port.get("port"), int) or not 0 < port["port"] < 65536:
                errors.append(cause_invalid(f"spec.ports[{i}].port", port.get("port"),
                                            "must be between 1 and 65535, inclusive"))
        if old is not None:
            old_ip = (old.get("spec") or {}).get("clusterIP")
            if spec.get("clusterIP", old_ip) != old_ip:
                errors.append(cause_invalid("spec.clusterIP", spec.get("clusterIP"),
                                            "field is immutable"))
    elif kind in ("Deployment", "StatefulSet", "ReplicaSet"):
        replicas = spec.get("replicas")
        if isinstance(replicas, int) and replicas < 0:
            errors.append(cause_invalid("spec.replicas", replicas,
                                        "must be greater than or equal to 0"))
        if not spec.get("selector"):
            errors.append(cause_required("spec.selector"))
    return errors


_RESTART_POLICIES = ["Always", "OnFailure", "Never"]


def pod_spec_errors(spec: dict[str, Any], path: str) -> list[FieldCause]:
    """The checks of a pod spec that manifests most often get wrong."""
    errors: list[FieldCause] = []
    containers = spec.get("containers")
    if not containers:
        errors.append(cause_required(f"{path}.containers"))
    policy = spec.get("restartPolicy")
    if policy is not None and policy not in _RESTART_POLICIES:
        errors.append(cause_not_supported(f"{path}.restartPolicy", policy, _RESTART_POLICIES))
    seen: set[str] = set()
    for group in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(group) or []):
            where = f"{path}.{group}[{i}]"
            cname = c.get("name")
            if not cname:
                errors.append(cause_required(f"{where}.name"))
            else:
                errors += name_errors("Namespace", cname, f"{where}.name")
                if cname in seen:
                    errors.append(cause_duplicate(f"{where}.name", cname))
                seen.add(cname)
            if not c.get("image"):
                errors.append(cause_required(f"{where}.image"))
            for j, port in enumerate(c.get("ports") or []):
                number = port.get("containerPort")
                if number is None:
                    errors.append(cause_required(f"{where}.ports[{j}].containerPort"))
                elif not 0 < number < 65536:
                    errors.append(cause_invalid(f"{where}.ports[{j}].containerPort", number,
                                                "must be between 1 and 65535, inclusive"))
            for j, env in enumerate(c.get("env") or []):
                if not env.get("name"):
                    errors.append(cause_required(f"{where}.env[{j}].name"))
    return errors


def _pod_update_errors(obj: dict[str, Any], old: dict[str, Any]) -> list[FieldCause]:
    """Pod specs are immutable apart from a few fields; nodeName only moves by binding."""
    spec, old_spec = dict(obj.get("spec") or {}), dict(old.get("spec") or {})
    for mutable in ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds",
                    "schedulingGates"):
        spec.pop(mutable, None)
        old_spec.pop(mutable, None)
    for key in ("containers", "initContainers"):
        # Images may change; everything else about the containers may not.
        spec[key] = [dict(c, image=None) for c in spec.get(key) or [] if isinstance(c, dict)]
        old_spec[key] = [dict(c, image=None) for c in old_spec.get(key) or []
                         if isinstance(c, dict)]
    if spec != old_spec:
        return [cause_forbidden(
            "spec", "pod updates may not change fields other than `spec.containers[*].image`,"
            "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` "
            "(only additions to existing tolerations),`spec.terminationGracePeriodSeconds` "
            "(allow it to be set to 1 if it was previously negative)")]
    return []


def strip_status_on_create(kind: str) -> bool:
    return kind not in ("Pod", "Service", "Namespace", "Node", "Event")
