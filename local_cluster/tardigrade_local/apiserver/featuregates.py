"""The API server's feature gates for pod fields that newer releases add.

Upstream, `dropDisabledFields` (pkg/api/pod/util.go) clears a field whose gate is off unless
the old object already uses it, and `GetValidationOptionsFromPodSpecAndMeta` (same file) lets
validation accept the `RestartAllContainers` action only when its gate is on or the old pod
uses it. Both gates default off here because this server imitates a release (discovery.py)
older than either feature; turning them on models a 1.35/1.36 control plane.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from .errors import FieldCause, cause_not_supported

CONTAINER_RESTART_RULES = "ContainerRestartRules"
RESTART_ALL_CONTAINERS = "RestartAllContainersOnContainerExits"
KNOWN = (CONTAINER_RESTART_RULES, RESTART_ALL_CONTAINERS)
ACTION_RESTART = "Restart"
ACTION_RESTART_ALL = "RestartAllContainers"


@dataclasses.dataclass(frozen=True)
class FeatureGates:
    container_restart_rules: bool = False
    restart_all_containers: bool = False

    @classmethod
    def parse(cls, text: str) -> FeatureGates:
        """`--feature-gates` syntax: `Name=true,Other=false`."""
        values: dict[str, bool] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or value.lower() not in ("true", "false"):
                raise ValueError(f"--feature-gates: {item!r} is not Name=true|false")
            if name not in KNOWN:
                raise ValueError(f"--feature-gates: unknown gate {name!r}; known: "
                                 f"{', '.join(KNOWN)}")
            values[name] = value.lower() == "true"
        return cls(container_restart_rules=values.get(CONTAINER_RESTART_RULES, False),
                   restart_all_containers=values.get(RESTART_ALL_CONTAINERS, False))


def _containers(spec: Mapping[str, Any] | None) -> Iterator[tuple[str, dict[str, Any]]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        for i, container in enumerate((spec or {}).get(key) or []):
            if isinstance(container, dict):
                yield f"spec.{key}[{i}]", container


def _rules_in_use(spec: Mapping[str, Any] | None) -> bool:
    """containerRestartRulesInUse: any rule, or a non-sidecar container-level policy."""
    for path, c in _containers(spec):
        sidecar = path.startswith("spec.initContainers") and c.get("restartPolicy") == "Always"
        if c.get("restartPolicyRules") or (c.get("restartPolicy") and not sidecar):
            return True
    return False


def _restart_all_in_use(spec: Mapping[str, Any] | None) -> bool:
    return any(rule.get("action") == ACTION_RESTART_ALL
               for _, c in _containers(spec) for rule in c.get("restartPolicyRules") or [])


def drop_disabled_pod_fields(spec: dict[str, Any] | None, old_spec: Mapping[str, Any] | None,
                             gates: FeatureGates) -> None:
    """dropContainerRestartRules, in place: what a pod loses when the gate is off."""
    if spec is None or gates.container_restart_rules or _rules_in_use(old_spec):
        return
    for path, c in _containers(spec):
        # A sidecar's `restartPolicy: Always` belongs to another (GA) feature and stays.
        if not (path.startswith("spec.initContainers") and c.get("restartPolicy") == "Always"):
            c.pop("restartPolicy", None)
        c.pop("restartPolicyRules", None)


def restart_rule_errors(spec: Mapping[str, Any] | None, old_spec: Mapping[str, Any] | None,
                        gates: FeatureGates) -> list[FieldCause]:
    """Actions validation accepts: `RestartAllContainers` only with its gate (or in use)."""
    allowed = [ACTION_RESTART]
    if gates.restart_all_containers or _restart_all_in_use(old_spec):
        allowed.append(ACTION_RESTART_ALL)
    errors: list[FieldCause] = []
    for path, c in _containers(spec):
        for j, rule in enumerate(c.get("restartPolicyRules") or []):
            action = rule.get("action")
            if action not in allowed:
                errors.append(cause_not_supported(f"{path}.restartPolicyRules[{j}].action",
                                                  action, allowed))
    return errors
