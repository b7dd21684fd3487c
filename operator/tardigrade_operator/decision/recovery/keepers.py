"""Restart in place: which pods of a gang a recovery keeps, and which it recreates, pure.

A kept pod's trainer exits with `contract.EXIT_RESTART_IN_PLACE`; its container's restart
rule (KEP-5307, `restartPolicyRules`, gate ContainerRestartRules, beta and on by default
since 1.35) makes the kubelet start it again in the same pod: same node, uid and IP, no
scheduling. Support is judged per pod and node, never per cluster:
- the API server drops the fields when its gate is off (dropDisabledFields in
  pkg/api/pod/util.go), so the rule must have survived on the created pod;
- kubelets may be older than the control plane, and an old kubelet ignores the rule: the
  node's `status.nodeInfo.kubeletVersion` must be 1.35 or later;
- a kubelet of 1.36 or later whose gate is off ignores the rule too, and reports the same
  version: it must declare `RestartAllContainersOnContainerExits` in the Node's
  `status.declaredFeatures` (KEP-5328; NodeDeclaredFeatures beta and on in 1.36). That gate
  depends on ContainerRestartRules (the kubelet refuses it on over the rules' gate off), so a
  kubelet that declares it runs restart rules. Restart rules declare nothing of their own: a
  1.36 kubelet with the rules on and RestartAllContainers off (or NodeDeclaredFeatures off)
  is taken for one without, and its ranks are recreated (slower, never wrong). A 1.35
  kubelet declares nothing by default and is judged by its version.
A rank on a node that fails either test, and every lost rank, gets a new pod as today.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tardigrade_contract import contract

# The first release whose kubelet restarts on rules by default (ContainerRestartRules beta,
# pkg/features/kube_features.go).
MIN_KUBELET = (1, 35)
# The first release whose kubelet declares its features by default (NodeDeclaredFeatures beta),
# among them RestartAllContainersOnContainerExits, on by default from then too.
DECLARING_KUBELET = (1, 36)
RESTART_ALL_CONTAINERS = "RestartAllContainersOnContainerExits"
_VERSION = re.compile(r"^v?(\d+)\.(\d+)")


def restart_rule() -> dict[str, Any]:
    """The container fields that make the kubelet restart the trainer on the in-place code;
    any other exit still ends the pod (container restartPolicy Never, as the pod's)."""
    return {"restartPolicy": "Never", "restartPolicyRules": [{
        "action": "Restart",
        "exitCodes": {"operator": "In", "values": [contract.EXIT_RESTART_IN_PLACE]}}]}


def _release(version: str) -> tuple[int, int] | None:
    found = _VERSION.match(version)
    return (int(found[1]), int(found[2])) if found is not None else None


def version_supports_rules(version: str) -> bool:
    """The kubelet version alone allows restart rules (`rules_kubelet_version` has read the
    rest of the Node)."""
    release = _release(version)
    return release is not None and release >= MIN_KUBELET


def kubelet_supports_rules(node: Mapping[str, Any] | None) -> bool:
    """The Node's kubelet restarts containers by their rules (the module's docstring)."""
    status = (node or {}).get("status") or {}
    release = _release(str((status.get("nodeInfo") or {}).get("kubeletVersion") or ""))
    if release is None or release < MIN_KUBELET:
        return False
    return release < DECLARING_KUBELET or RESTART_ALL_CONTAINERS in (
        status.get("declaredFeatures") or [])


def rules_kubelet_version(status: Mapping[str, Any]) -> str:
    """What the operator indexes per Node: its kubelet's version where the kubelet runs
    restart rules, "" where it does not."""
    if not kubelet_supports_rules({"status": status}):
        return ""
    return str((status.get("nodeInfo") or {}).get("kubeletVersion") or "")


def rule_survived(pod: Mapping[str, Any]) -> bool:
    """The API server kept the trainer's in-place rule (its gate is on)."""
    containers = (pod.get("spec") or {}).get("containers") or []
    return any(rule.get("action") == "Restart"
               and contract.EXIT_RESTART_IN_PLACE in
               ((rule.get("exitCodes") or {}).get("values") or [])
               for c in containers for rule in c.get("restartPolicyRules") or [])


@dataclasses.dataclass(frozen=True)
class Member:
    """One pod of the running gang, as a recovery sees it."""

    name: str
    rank: int
    healthy: bool  # running, not deleting, its node not lost or shutting down
    can_restart: bool  # rule_survived and kubelet_supports_rules, or restarts in process


@dataclasses.dataclass(frozen=True)
class Keep:
    name: str
    old_rank: int
    rank: int


@dataclasses.dataclass(frozen=True)
class InPlacePlan:
    keep: tuple[Keep, ...]
    # Pods to stop and delete (lost, unhealthy, unable to restart, or surplus on a shrink).
    delete: tuple[str, ...]
    # New world ranks that get a new pod.
    create_ranks: tuple[int, ...]

    @property
    def in_place(self) -> bool:
        return bool(self.keep)


def plan(members: Sequence[Member], replicas: int, enabled: bool) -> InPlacePlan:
    """Keep every healthy pod that can restart and whose rank is in the new world; recreate
    the rest.

    A kept pod keeps its rank: the rendezvous admits a rank only from the pod whose name
    carries that rank (trainer peerauth.py, `rejection`), so a pod cannot take over another
    rank without a new name, that is a new pod."""
    if not enabled:
        return InPlacePlan((), tuple(m.name for m in members), tuple(range(replicas)))
    keep: dict[int, Keep] = {}
    for m in sorted(members, key=lambda m: m.rank):
        if m.healthy and m.can_restart and m.rank < replicas and m.rank not in keep:
            keep[m.rank] = Keep(m.name, m.rank, m.rank)
    kept = {k.name for k in keep.values()}
    return InPlacePlan(
        keep=tuple(keep[r] for r in sorted(keep)),
        delete=tuple(m.name for m in members if m.name not in kept),
        create_ranks=tuple(r for r in range(replicas) if r not in keep),
    )
