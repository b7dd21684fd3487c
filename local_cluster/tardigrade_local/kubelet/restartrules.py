"""What the kubelet does when a container exits: container restart rules (KEP-5307) and
restarting all of a pod's containers (KEP-5532), pure.

Follows `ContainerShouldRestart` and `findMatchingContainerRestartRule` (kubernetes
pkg/api/v1/pod/util.go, which the kubelet calls). A kubelet whose gate is off does not know
the fields at all: the pod-level policy decides, as on a release older than the feature.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

CONTAINER_RESTART_RULES = "ContainerRestartRules"
RESTART_ALL_CONTAINERS = "RestartAllContainersOnContainerExits"
# The pod condition the kubelet holds True while it tears the containers down (KEP-5532,
# "Pod condition AllContainersRestarting"; v1.AllContainersRestarting in the kubelet).
ALL_CONTAINERS_RESTARTING = "AllContainersRestarting"


class OnExit(enum.Enum):
    STOP = "stop"
    RESTART = "restart"
    RESTART_ALL = "restart-all"


@dataclasses.dataclass(frozen=True)
class KubeletGates:
    """The gates of a 1.36 kubelet, defaults as `pkg/features/kube_features.go` of the pinned
    release: ContainerRestartRules beta and on since 1.35, RestartAllContainersOnContainerExits
    beta and on in 1.36."""

    container_restart_rules: bool = True
    restart_all_containers: bool = True

    @classmethod
    def from_mapping(cls, gates: Mapping[str, bool]) -> KubeletGates:
        return cls(container_restart_rules=bool(gates.get(CONTAINER_RESTART_RULES, True)),
                   restart_all_containers=bool(gates.get(RESTART_ALL_CONTAINERS, True)))

    def declared_features(self) -> list[str]:
        """Node.status.declaredFeatures (KEP-5328): the restartallcontainers feature's
        `Discover` is its gate (component-helpers nodedeclaredfeatures/features/
        restartallcontainers); restart rules alone declare nothing."""
        return [RESTART_ALL_CONTAINERS] if self.restart_all_containers else []


def matching_rule(container: Mapping[str, Any], exit_code: int) -> Mapping[str, Any] | None:
    """findMatchingContainerRestartRule: the first rule whose exit codes match, in order."""
    for rule in container.get("restartPolicyRules") or []:
        codes = rule.get("exitCodes")
        if not codes:
            continue
        listed = exit_code in [int(v) for v in codes.get("values") or []]
        operator = codes.get("operator")
        if (operator == "In" and listed) or (operator == "NotIn" and not listed):
            return rule
    return None


def _policy_restarts(policy: str | None, exit_code: int) -> bool:
    if policy == "Never":
        return False
    if policy == "OnFailure":
        return exit_code != 0
    return True  # Always, and the API default


def on_exit(container: Mapping[str, Any], pod_policy: str | None, exit_code: int,
            gates: KubeletGates) -> OnExit:
    container_policy = container.get("restartPolicy") if gates.container_restart_rules else None
    if container_policy is not None:
        rule = matching_rule(container, exit_code)
        action = (rule or {}).get("action")
        if action == "Restart":
            return OnExit.RESTART
        if action == "RestartAllContainers" and gates.restart_all_containers:
            return OnExit.RESTART_ALL
        # No rule (or an action this kubelet lacks): the container-level policy decides.
        return OnExit.RESTART if _policy_restarts(container_policy, exit_code) else OnExit.STOP
    return OnExit.RESTART if _policy_restarts(pod_policy, exit_code) else OnExit.STOP
