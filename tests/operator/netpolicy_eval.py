"""A small NetworkPolicy evaluator, written from the API's documented semantics.

The local cluster does not enforce NetworkPolicy, so the operator's policies are proved here
instead. Sources: the NetworkPolicy API reference (networking.k8s.io/v1, kubernetes.io/docs
reference/kubernetes-api/policy-resources/network-policy-v1) and the "Network Policies"
concept page; validation as `pkg/apis/networking/validation/validation.go`
(`ValidateNetworkPolicySpec`, `ValidateNetworkPolicyPort`, `ValidateNetworkPolicyPeer`).

- A pod is isolated for ingress once any policy in its namespace selects it (podSelector) with
  Ingress in policyTypes (policyTypes defaults to Ingress, plus Egress when egress rules
  exist). Then only traffic some selecting policy allows gets in; policies are additive.
- A rule allows a connection when a peer in `from` matches the source (no `from`: any source)
  and a port in `ports` matches (no `ports`: any port; protocol defaults to TCP; a named port
  matches the destination container's port of that name; endPort makes a range).
- A peer: podSelector alone = pods of the policy's namespace; namespaceSelector alone = every
  pod of the selected namespaces; both = pods matching podSelector in the selected
  namespaces; ipBlock = source IPs in cidr and not in except.
- An empty LabelSelector matches everything; matchExpressions: In, NotIn, Exists,
  DoesNotExist.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from typing import Any

PROTOCOLS = ("TCP", "UDP", "SCTP")
_IANA_SVC_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


@dataclasses.dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict[str, str]
    ip: str = "10.0.0.1"
    # name -> (protocol, port) of the container ports, for named ports in policies
    ports: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)


def selector_matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


def validate(policy: dict[str, Any]) -> list[str]:
    """What the API server would refuse (the parts of ValidateNetworkPolicySpec we use)."""
    errors: list[str] = []
    spec = policy.get("spec") or {}
    if "podSelector" not in spec:
        errors.append("spec.podSelector: Required value")
    types_ = spec.get("policyTypes") or []
    if any(t not in ("Ingress", "Egress") for t in types_) or len(set(types_)) != len(types_):
        errors.append("spec.policyTypes: Unsupported or duplicate value")
    for i, rule in enumerate(spec.get("ingress") or []):
        for j, port in enumerate(rule.get("ports") or []):
            where = f"spec.ingress[{i}].ports[{j}]"
            if port.get("protocol", "TCP") not in PROTOCOLS:
                errors.append(f"{where}.protocol: Unsupported value")
            value = port.get("port")
            if isinstance(value, int) and not 1 <= value <= 65535:
                errors.append(f"{where}.port: must be between 1 and 65535")
            if isinstance(value, str) and not (_IANA_SVC_NAME.match(value) and len(value) <= 15):
                errors.append(f"{where}.port: must be an IANA_SVC_NAME")
            if "endPort" in port and (not isinstance(value, int) or port["endPort"] < value):
                errors.append(f"{where}.endPort: must be a number >= port")
        for j, peer in enumerate(rule.get("from") or []):
            where = f"spec.ingress[{i}].from[{j}]"
            selectors = "podSelector" in peer or "namespaceSelector" in peer
            if selectors == ("ipBlock" in peer):
                errors.append(f"{where}: must specify exactly one of ipBlock or "
                              "podSelector/namespaceSelector")
    return errors


def _policy_types(spec: dict[str, Any]) -> list[str]:
    if spec.get("policyTypes"):
        return list(spec["policyTypes"])
    return ["Ingress", *(["Egress"] if spec.get("egress") else [])]


def _peer_matches(peer: dict[str, Any], policy_ns: str, source: Pod,
                  namespaces: dict[str, dict[str, str]]) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(source.ip)
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(e) for e in block.get("except") or [])
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], namespaces.get(source.namespace, {})):
            return False
    elif source.namespace != policy_ns:
        return False
    return "podSelector" not in peer or selector_matches(peer["podSelector"], source.labels)


def _port_matches(port: dict[str, Any], target: Pod, protocol: str, number: int) -> bool:
    if port.get("protocol", "TCP") != protocol:
        return False
    value = port.get("port")
    if value is None:
        return True
    if isinstance(value, str):
        return target.ports.get(value) == (protocol, number)
    return value <= number <= port.get("endPort", value)


def allowed(policies: list[dict[str, Any]], source: Pod, target: Pod, port: int,
            namespaces: dict[str, dict[str, str]], protocol: str = "TCP") -> bool:
    """May `source` open a connection to `target` on `port`? `namespaces`: name -> labels."""
    selecting = [p for p in policies
                 if p["metadata"]["namespace"] == target.namespace
                 and selector_matches(p["spec"]["podSelector"], target.labels)
                 and "Ingress" in _policy_types(p["spec"])]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            ports = rule.get("ports")
            peer_ok = not peers or any(
                _peer_matches(peer, policy["metadata"]["namespace"], source, namespaces)
                for peer in peers)
            port_ok = not ports or any(_port_matches(p, target, protocol, port) for p in ports)
            if peer_ok and port_ok:
                return True
    return False
