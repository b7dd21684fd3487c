"""What a real kubelet is told so that its Node looks like a `NodeConfig`, as GKE's node pools
shape theirs. Pure: `RealNode` applies it.

- Labels: the kubelet's `--node-labels`, set when it registers (GKE's node pools do the same:
  `--node-labels` in the kubelet's flags of a GKE node). The pool goes into
  `cloud.google.com/gke-nodepool`. The kubelet and NodeRestriction refuse a label of the
  `kubernetes.io` / `k8s.io` namespaces outside an allowed set (cmd/kubelet/app/options
  `ValidateKubeletFlags`, pkg/kubelet/apis/well_known_labels.go: the `kubelet.kubernetes.io`
  and `node.kubernetes.io` namespaces and a few well-known keys; never
  `node-restriction.kubernetes.io`), so such a label is refused here first, naming it.
- Taints: KubeletConfiguration `registerWithTaints` (a node cannot taint itself once
  registered: NodeRestriction).
- cpu and memory: a real kubelet reports the machine's as capacity (cAdvisor) and
  allocatable = capacity - systemReserved - kubeReserved - the hard eviction threshold
  (Kubernetes docs, "Reserve Compute Resources for System Daemons"; GKE reserves the same
  way, "Node allocatable resources"). The template's figure is the allocatable one, so the
  rest of the machine goes to `systemReserved`; a template larger than the machine is refused.
- pods: KubeletConfiguration `maxPods` (the kubelet reports it as capacity and allocatable).
- Extended resources (`google.com/tpu`, `nvidia.com/gpu`): no device plugin runs here, so
  they are advertised as the Kubernetes docs' "Advertise Extended Resources for a Node"
  does: a JSON PATCH of the Node's `status.capacity`. The kubelet keeps an extended resource
  it did not set in the capacity of its later status updates and derives its allocatable
  from it (pkg/kubelet/nodestatus/setters.go, `MachineInfo`).
- ephemeral-storage: not applied (the real nodes run with `localStorageCapacityIsolation`
  off: the kubelet reports none).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from tardigrade_local.gke.nodes import NODE_POOL_LABEL, NodeConfig

# The kubelet's default hard eviction threshold for memory (`evictionHard`
# `memory.available`, pkg/kubelet/apis/config/v1beta1/defaults_linux.go): subtracted from
# allocatable besides the reservations.
EVICTION_HARD_MEMORY_BYTES = 100 * 2**20
# Resources the kubelet itself reports; any other must be an extended resource.
KUBELET_RESOURCES = ("cpu", "memory", "pods", "ephemeral-storage")
# Labels a kubelet may set on its own Node in the kubernetes.io and k8s.io namespaces
# (pkg/kubelet/apis/well_known_labels.go `kubeletLabels`).
KUBELET_LABELS = frozenset({
    "kubernetes.io/hostname", "kubernetes.io/os", "kubernetes.io/arch",
    "beta.kubernetes.io/os", "beta.kubernetes.io/arch", "beta.kubernetes.io/instance-type",
    "node.kubernetes.io/instance-type", "topology.kubernetes.io/zone",
    "topology.kubernetes.io/region", "failure-domain.beta.kubernetes.io/zone",
    "failure-domain.beta.kubernetes.io/region"})
KUBELET_LABEL_NAMESPACES = ("kubelet.kubernetes.io", "node.kubernetes.io")
FORBIDDEN_LABEL_NAMESPACE = "node-restriction.kubernetes.io"


class NodeShapeError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the kubelet reports as capacity on this machine (cAdvisor: the CPUs, MemTotal)."""

    cpu_millis: int
    memory_bytes: int

    def capacity(self) -> dict[str, str]:
        return {"cpu": f"{self.cpu_millis}m", "memory": str(self.memory_bytes)}

    @classmethod
    def here(cls) -> Machine:
        """This machine, as cAdvisor reads it: its online CPUs and /proc/meminfo's MemTotal
        (RealNode checks the Node's allocatable afterwards, so a difference is caught)."""
        memory = 0
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    memory = int(line.split()[1]) * 1024
        return cls(cpu_millis=(os.cpu_count() or 1) * 1000, memory_bytes=memory)


@dataclasses.dataclass(frozen=True)
class KubeletShape:
    """`node_labels`: the `--node-labels` flag's value; `config`: KubeletConfiguration fields;
    `extended`: what the Node's status.capacity gets by PATCH; `allocatable`: cpu and memory
    the Node must then show (in millicores and bytes)."""

    node_labels: str
    config: dict[str, Any]
    extended: dict[str, str]
    allocatable: dict[str, Decimal]


def labels_of(config: NodeConfig) -> dict[str, str]:
    """The node's labels, its pool's among them."""
    return {**config.labels, NODE_POOL_LABEL: config.pool}


def is_extended_resource(name: str) -> bool:
    """As the API server has it (v1helper.IsExtendedResourceName): a domain-qualified name
    outside the kubernetes.io namespace, not `requests.*`."""
    domain, slash, _ = name.partition("/")
    return (bool(slash) and not name.startswith("requests.")
            and domain != "kubernetes.io" and not domain.endswith(".kubernetes.io"))


def shape(config: NodeConfig, machine: Machine) -> KubeletShape:
    """How node `config.name`'s kubelet is configured; NodeShapeError naming the field if the
    config cannot be a real node of this machine."""
    labels = labels_of(config)
    for key, value in labels.items():
        _check_label(config.name, key, value)
    taints = [_taint(config.name, t) for t in config.taints]
    kubelet: dict[str, Any] = {}
    if taints:
        kubelet["registerWithTaints"] = taints
    reserved: dict[str, str] = {}
    allocatable: dict[str, Decimal] = {}
    extended: dict[str, str] = {}
    for resource, text in config.capacity.items():
        amount = _quantity(config.name, resource, text)
        if resource == "cpu":
            want = int(amount * 1000)
            rest = machine.cpu_millis - want
            if rest < 0:
                raise NodeShapeError(
                    f"node {config.name}: capacity.cpu {text} is more than this machine's "
                    f"{machine.cpu_millis / 1000:g} CPUs, which a real kubelet reports: give "
                    f"it at most {machine.cpu_millis}m")
            if rest:
                reserved["cpu"] = f"{rest}m"
            allocatable["cpu"] = Decimal(want)
        elif resource == "memory":
            want = int(amount)
            rest = machine.memory_bytes - EVICTION_HARD_MEMORY_BYTES - want
            if rest < 0:
                most = machine.memory_bytes - EVICTION_HARD_MEMORY_BYTES
                raise NodeShapeError(
                    f"node {config.name}: capacity.memory {text} is more than this machine's "
                    f"memory less the kubelet's eviction threshold: give it at most "
                    f"{most // 2**20}Mi")
            if rest:
                reserved["memory"] = str(rest)
            allocatable["memory"] = Decimal(want)
        elif resource == "pods":
            if amount != int(amount) or amount < 1:
                raise NodeShapeError(f"node {config.name}: capacity.pods {text} must be a "
                                     f"whole number of at least 1")
            kubelet["maxPods"] = int(amount)
        elif resource == "ephemeral-storage":
            continue  # no local storage accounting on the real nodes (module docstring)
        elif is_extended_resource(resource):
            if amount != int(amount) or amount < 0:
                raise NodeShapeError(f"node {config.name}: capacity.{resource} {text}: an "
                                     f"extended resource is a whole number of devices")
            extended[resource] = str(int(amount))
        else:
            raise NodeShapeError(
                f"node {config.name}: capacity.{resource} is neither one the kubelet reports "
                f"({', '.join(KUBELET_RESOURCES)}) nor an extended resource (a "
                f"domain-qualified name such as google.com/tpu)")
    if reserved:
        kubelet["systemReserved"] = reserved
    node_labels = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return KubeletShape(node_labels, kubelet, extended, allocatable)


def capacity_patch(extended: Mapping[str, str]) -> list[dict[str, str]]:
    """The JSON PATCH of `/api/v1/nodes/NAME/status` that advertises `extended` (the docs'
    "Advertise Extended Resources for a Node": `~1` stands for the `/` in a name, RFC 6901)."""
    return [{"op": "add", "path": "/status/capacity/" + name.replace("~", "~0").replace(
        "/", "~1"), "value": value} for name, value in sorted(extended.items())]


def mismatches(shape_: KubeletShape, node: Mapping[str, Any]) -> list[str]:
    """What of `shape_` the Node object `node` does not show yet (empty: all of it)."""
    status = node.get("status") or {}
    allocatable = status.get("allocatable") or {}
    capacity = status.get("capacity") or {}
    wrong = []
    for resource, want in shape_.allocatable.items():
        have = allocatable.get(resource)
        got = parse_quantity(str(have)) * (1000 if resource == "cpu" else 1) if have else None
        if got != want:
            wrong.append(f"allocatable {resource} {have} (wanted "
                         f"{f'{want}m' if resource == 'cpu' else want})")
    for resource, want_text in shape_.extended.items():
        for field, found in (("capacity", capacity), ("allocatable", allocatable)):
            if str(found.get(resource)) != want_text:
                wrong.append(f"{field} {resource} {found.get(resource)} (wanted {want_text})")
    return wrong


def _quantity(node: str, resource: str, text: str) -> Decimal:
    try:
        return Decimal(parse_quantity(str(text)))
    except ValueError:
        raise NodeShapeError(f"node {node}: capacity.{resource} {text!r} is not a quantity "
                             f"(e.g. 2, 500m, 4Gi)") from None


def _check_label(node: str, key: str, value: str) -> None:
    if "," in value or "=" in value:
        raise NodeShapeError(f"node {node}: label {key}={value!r}: a label value holds no "
                             f"',' or '='")
    domain = key.partition("/")[0] if "/" in key else ""
    if domain == FORBIDDEN_LABEL_NAMESPACE or domain.endswith("." + FORBIDDEN_LABEL_NAMESPACE):
        raise NodeShapeError(f"node {node}: label {key}: a kubelet may never set labels of "
                             f"{FORBIDDEN_LABEL_NAMESPACE} (NodeRestriction); an admin adds "
                             f"them to the Node")
    restricted = any(domain == ns or domain.endswith("." + ns)
                     for ns in ("kubernetes.io", "k8s.io"))
    allowed = key in KUBELET_LABELS or any(domain == ns or domain.endswith("." + ns)
                                           for ns in KUBELET_LABEL_NAMESPACES)
    if restricted and not allowed:
        raise NodeShapeError(
            f"node {node}: label {key}: the kubelet refuses --node-labels of the kubernetes.io "
            f"and k8s.io namespaces outside kubelet.kubernetes.io, node.kubernetes.io and "
            f"the well-known keys ({', '.join(sorted(KUBELET_LABELS))}); use another domain "
            f"(e.g. cloud.google.com/...)")


def _taint(node: str, taint: Mapping[str, str]) -> dict[str, str]:
    effect = taint.get("effect")
    if not taint.get("key") or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
        raise NodeShapeError(f"node {node}: taint {dict(taint)} needs a key and an effect of "
                             f"NoSchedule, PreferNoSchedule or NoExecute")
    return {"key": str(taint["key"]), "effect": str(effect),
            **({"value": str(taint["value"])} if taint.get("value") else {})}
