"""What the kubelet does when a container exits: container restart rules (KEP-5307) and
restarting all of a pod's containers (KEP-5532), pure.

Follows `ContainerShouldRestart` and `findMatchingContainerRestartRule` (kubernetes
pkg/api/v1/pod/util.go, which the kubelet calls). A kubelet whose gate is off does not know
the fields at all: the pod-level policy decides, as on a release older than the feature.
"""

from __future__ import annotations

import dataclasses
import enum
import re
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


# The gates' history in kubernetes `pkg/features/kube_features.go` (the pinned 1.36 release):
# gate -> [(first minor release with this stage, on by default)]. A kubelet older than the
# first entry does not know the feature at all.
GATE_HISTORY: dict[str, list[tuple[int, bool]]] = {
    CONTAINER_RESTART_RULES: [(34, False), (35, True)],  # alpha 1.34, beta 1.35
    RESTART_ALL_CONTAINERS: [(35, False), (36, True)],  # alpha 1.35, beta 1.36
}


def _minor(version: str) -> int:
    match = re.match(r"v?1\.(\d+)", version)
    if match is None:
        raise ValueError(f"kubelet version {version!r} is not v1.MINOR[.PATCH]")
    return int(match.group(1))


def gate_default(gate: str, version: str) -> bool:
    """Whether a kubelet of `version` has `gate` on unless told otherwise."""
    on = False
    for since, default in GATE_HISTORY[gate]:
        if _minor(version) >= since:
            on = default
    return on


def gate_known(gate: str, version: str) -> bool:
    return _minor(version) >= GATE_HISTORY[gate][0][0]


@dataclasses.dataclass(frozen=True)
class KubeletGates:
    container_restart_rules: bool = False
    restart_all_containers: bool = False

    @classmethod
    def of(cls, version: str, overrides: Mapping[str, bool]) -> KubeletGates:
        """A kubelet of `version` with `--feature-gates` `overrides`: a gate its release does
        not know stays off whatever it is told (the kubelet would refuse to start)."""
        def gate(name: str) -> bool:
            if not gate_known(name, version):
                return False
            return bool(overrides.get(name, gate_default(name, version)))

        return cls(container_restart_rules=gate(CONTAINER_RESTART_RULES),
                   restart_all_containers=gate(RESTART_ALL_CONTAINERS))

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
