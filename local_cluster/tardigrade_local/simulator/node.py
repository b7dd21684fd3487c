"""The Node object a simulated node registers, pure."""

from __future__ import annotations

import platform
from typing import Any

from tardigrade_local import gobuild
from tardigrade_local.gke import nodes as gke_nodes
from tardigrade_local.gke.events import now_rfc3339
from tardigrade_local.gke.nodes import NodeConfig
from tardigrade_local.simulator.config import SIMULATED_ANNOTATION, SIMULATED_RUNTIME_VERSION
from tardigrade_local.simulator.restartrules import KubeletGates

# What the node agents report, and whose behaviour they follow: the pinned release's kubelet.
KUBELET_VERSION = gobuild.kubernetes_version()
MANAGED_ANNOTATION = "local.tardigrade.dev/kubelet"


def kubelet_gates(config: NodeConfig) -> KubeletGates:
    """The node's kubelet's gates: its release's defaults, then its own --feature-gates."""
    return KubeletGates.of(config.kubelet_version or KUBELET_VERSION, config.feature_gates)


def node_labels(config: NodeConfig) -> dict[str, str]:
    """A real node's (gke/nodes.py), marked as a machine of no instance type."""
    return {**gke_nodes.node_labels(config), "node.kubernetes.io/instance-type": "local"}


def ready_conditions(ready: bool, message: str = "") -> list[dict[str, Any]]:
    now = now_rfc3339()

    def cond(kind: str, status: str, reason: str, text: str) -> dict[str, Any]:
        return {"type": kind, "status": status, "reason": reason, "message": text,
                "lastHeartbeatTime": now, "lastTransitionTime": now}

    return [
        cond("MemoryPressure", "False", "KubeletHasSufficientMemory",
             "kubelet has sufficient memory available"),
        cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
        cond("PIDPressure", "False", "KubeletHasSufficientPID",
             "kubelet has sufficient PID available"),
        cond("Ready", "True", "KubeletReady", "kubelet is posting ready status")
        if ready else cond("Ready", "False", "KubeletNotReady", message),
    ]


def node_annotations(config: NodeConfig) -> dict[str, str]:
    marks = {MANAGED_ANNOTATION: "true"}
    if config.simulated:
        marks[SIMULATED_ANNOTATION] = "true"
    return marks


def node_status(config: NodeConfig, ip: str, port: int, ready: bool = True,
                message: str = "") -> dict[str, Any]:
    version = config.kubelet_version or KUBELET_VERSION
    status: dict[str, Any] = {
        "capacity": dict(config.capacity),
        "allocatable": dict(config.capacity),
        "conditions": ready_conditions(ready, message),
        "addresses": [{"type": "InternalIP", "address": ip},
                      {"type": "Hostname", "address": config.name}],
        # A simulated node serves no kubelet endpoint (no `kubectl logs`): port 0.
        "daemonEndpoints": {"kubeletEndpoint": {"Port": port}},
        "nodeInfo": {
            "machineID": config.name, "systemUUID": config.name, "bootID": config.name,
            "kernelVersion": platform.release(), "osImage": "simulated",
            "containerRuntimeVersion": SIMULATED_RUNTIME_VERSION,
            "kubeletVersion": version, "kubeProxyVersion": version, "operatingSystem": "linux",
            "architecture": gke_nodes.arch(),
        },
    }
    declared = kubelet_gates(config).declared_features()
    if declared:
        status["declaredFeatures"] = declared
    return status


def node_object(config: NodeConfig, ip: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": config.name,
            "labels": node_labels(config),
            "annotations": node_annotations(config),
        },
        "spec": {"taints": [dict(t) for t in config.taints]} if config.taints else {},
        "status": node_status(config, ip, port),
    }
