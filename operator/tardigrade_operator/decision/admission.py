"""What the cluster admin lets a TrainingJob's pods do, checked before any pod is created.

The operator creates pods with its own (broad) rights, so without this a TrainingJob would be a
way around Pod Security Admission: `podTemplate` could carry hostPath volumes, AppArmor or
seccomp "unconfined", or schedule onto control-plane nodes with system priority, or use
whatever ServiceAccount, Secret or storage the namespace holds. Three rules:

- Pod Security (`podSecurity`: restricted, baseline or privileged): the rendered pod must pass
  that Pod Security Standard (tardigrade_operator.decision.podsecurity, upstream's checks).
- System scheduling (`allowSystemScheduling`): Pod Security says nothing about tolerations,
  node selectors or priority classes, so the operator refuses, unless allowed, a toleration of
  every taint, control-plane node selectors and tolerations, and the system-node-critical and
  system-cluster-critical priority classes.
- Grants (`serviceAccounts`, `secrets`, `volumeTypes`, `csiDrivers`, `priorityClasses`): what
  of the namespace the pods may use, allow lists (grants.py).

Errors name the TrainingJob field that put the setting into the pod.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from tardigrade_operator.api.parse import FieldError
from tardigrade_operator.api.types import TrainingJobSpec
from tardigrade_operator.decision import grants
from tardigrade_operator.decision.grants import SYSTEM_PRIORITY_CLASSES, Grants
from tardigrade_operator.decision.podsecurity import LEVELS, Level, check_pod
from tardigrade_operator.rendering.manifests import GangLaunch, JobRef, build_pod, runs_as_root

CONTROL_PLANE_LABELS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
_POD_VOLUME = re.compile(r"^spec\.volumes\[(\d+)\](.*)$")


@dataclasses.dataclass(frozen=True)
class AdmissionPolicy:
    """The admin's rules (operator settings; chart values admission.*)."""

    # baseline, not restricted: TPU pods run as root (manifests.runs_as_root), as GKE's own TPU
    # samples do; CPU and GPU pods meet restricted, which an admin without TPU jobs can choose.
    pod_security: Level = "baseline"
    allow_system_scheduling: bool = False
    # What of the namespace the pods may use: service accounts, Secrets, volumes, CSI
    # drivers, priority classes (grants.py).
    grants: Grants = dataclasses.field(default_factory=Grants)

    @classmethod
    def parse(cls, pod_security: str, allow_system_scheduling: str,
              lists: Mapping[str, str | None] | None = None) -> AdmissionPolicy:
        """From the operator's settings; `lists` holds grants.SETTINGS' variables."""
        if pod_security not in LEVELS:
            raise ValueError(f"TARDIGRADE_POD_SECURITY={pod_security!r}: expected one of "
                             f"{', '.join(LEVELS)} (chart value admission.podSecurity)")
        flag = allow_system_scheduling.strip().lower()
        if flag not in ("true", "false"):
            raise ValueError(f"TARDIGRADE_ALLOW_SYSTEM_SCHEDULING={allow_system_scheduling!r}: "
                             "expected true or false (chart value "
                             "admission.allowSystemScheduling)")
        return cls(pod_security, flag == "true",  # type: ignore[arg-type]
                   Grants.from_settings(lists or {}))


# What the operator itself sets for TPU pods (manifests.runs_as_root) and restricted forbids.
ROOT_CHECKS = frozenset({"runAsNonRoot", "runAsUser", "capabilities"})


def review(job: JobRef, spec: TrainingJobSpec, policy: AdmissionPolicy) -> list[FieldError]:
    """Everything in `spec` that `policy` forbids, one error per offending field."""
    errors = _scheduling_errors(spec) if not policy.allow_system_scheduling else []
    # With every optional addition of the operator's (restart in place adds a volume), so that
    # those are reviewed too.
    pod = build_pod(job, spec, GangLaunch(attempt=0, replicas=spec.replicas,
                                          restore_step="latest", restart_in_place=True), rank=0)
    errors += grants.review(spec, pod, policy.grants)
    violations = check_pod(pod, policy.pod_security)
    if runs_as_root(spec) and any(v.check in ROOT_CHECKS for v in violations):
        violations = [v for v in violations if v.check not in ROOT_CHECKS]
        errors.append(FieldError(
            "spec.accelerator.kind",
            f"TPU pods run as root with the runtime's default capabilities, as GKE's TPU "
            f"samples do (no non-root TPU setup is documented), which Pod Security restricted "
            f"forbids and this operator enforces (podSecurity={policy.pod_security}): ask the "
            "cluster admin for baseline (chart value admission.podSecurity, and the namespace's "
            "pod-security.kubernetes.io/enforce label)"))
    for violation in violations:
        errors.append(FieldError(
            _spec_field(violation.field, spec),
            f"{violation.detail}: forbidden by Pod Security {violation.level!r} (check "
            f"{violation.check}), which this operator enforces (podSecurity="
            f"{policy.pod_security}); remove it, or ask the cluster admin to allow it (chart "
            "value admission.podSecurity)"))
    return errors


def _spec_field(pod_field: str, spec: TrainingJobSpec) -> str:
    """The TrainingJob field a pod field came from (only podTemplate reaches these)."""
    volume = _POD_VOLUME.match(pod_field)
    if volume and int(volume.group(1)) < len(spec.pod_template.volumes):
        return f"spec.podTemplate.volumes[{volume.group(1)}]{volume.group(2)}"
    if pod_field.startswith("metadata.annotations"):
        return "spec.podTemplate.annotations"
    return "spec.podTemplate"


def _scheduling_errors(spec: TrainingJobSpec) -> list[FieldError]:
    fix = ("; ask the cluster admin to allow it (chart value admission.allowSystemScheduling) "
           "or remove it")
    errors: list[FieldError] = []
    sources: list[tuple[str, list[Any], dict[str, str]]] = [
        ("spec.podTemplate", spec.pod_template.tolerations, spec.pod_template.node_selector)]
    if spec.spot.enabled:
        sources.append(("spec.spot", spec.spot.tolerations, spec.spot.node_selector))
    for prefix, tolerations, selector in sources:
        for i, toleration in enumerate(tolerations):
            field = f"{prefix}.tolerations[{i}]"
            if toleration.key in (None, "") and toleration.operator == "Exists":
                errors.append(FieldError(field, "a toleration without a key and operator "
                                         "Exists tolerates every taint (control-plane, "
                                         "NotReady, NoExecute)" + fix))
            elif toleration.key in CONTROL_PLANE_LABELS:
                errors.append(FieldError(field, f"tolerating {toleration.key} lets trainer "
                                         "pods onto control-plane nodes" + fix))
        for key in selector:
            if key in CONTROL_PLANE_LABELS:
                errors.append(FieldError(f"{prefix}.nodeSelector", f"{key} selects "
                                         "control-plane nodes" + fix))
    priority = spec.pod_template.priority_class_name
    if priority in SYSTEM_PRIORITY_CLASSES:
        errors.append(FieldError("spec.podTemplate.priorityClassName",
                                 f"{priority} is for pods the node or cluster cannot run "
                                 "without; it would let a training job preempt them" + fix))
    return errors
