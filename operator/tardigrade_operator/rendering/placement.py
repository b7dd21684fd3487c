"""Where trainer pods may run: accelerator and spot settings -> node selectors, tolerations,
resource limits, the way GKE node pools expect them."""

from __future__ import annotations

import dataclasses
from typing import Any

from tardigrade_operator.api.types import TrainingJobSpec

GKE_GPU_LABEL = "cloud.google.com/gke-accelerator"
GKE_TPU_LABEL = "cloud.google.com/gke-tpu-accelerator"
GKE_TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
GPU_RESOURCE = "nvidia.com/gpu"
TPU_RESOURCE = "google.com/tpu"


@dataclasses.dataclass(frozen=True)
class Placement:
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    # Quantities as strings: the Kubernetes client's models refuse integers.
    accelerator_limits: dict[str, str]


def placement_for(spec: TrainingJobSpec) -> Placement:
    selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    limits: dict[str, str] = {}
    accel = spec.accelerator
    if accel.kind == "nvidia-gpu" and accel.type:
        selector[GKE_GPU_LABEL] = accel.type
        limits[GPU_RESOURCE] = str(accel.count or 1)
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    elif accel.kind == "tpu" and accel.type and accel.topology:
        selector[GKE_TPU_LABEL] = accel.type
        selector[GKE_TPU_TOPOLOGY_LABEL] = accel.topology
        limits[TPU_RESOURCE] = str(accel.count or 4)
        tolerations.append({"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    if spec.spot.enabled:
        selector.update(spec.spot.node_selector)
        tolerations.extend(_dump(t) for t in spec.spot.tolerations)
    selector.update(spec.pod_template.node_selector)
    tolerations.extend(_dump(t) for t in spec.pod_template.tolerations)
    return Placement(selector, _unique(tolerations), limits)


def _dump(model: Any) -> dict[str, Any]:
    return model.model_dump(by_alias=True, exclude_none=True)


def _unique(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen
