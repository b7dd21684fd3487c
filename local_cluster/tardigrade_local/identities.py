"""Who is who in the local cluster: the client certificates the CA issues, and the RBAC of
the identities that are ours (not Kubernetes' own).

- `admin`: the cluster administrator (`system:masters`), for users, kubectl, helm and tests;
- `kube-controller-manager` and `kube-scheduler`: the users kubeadm gives them, whose roles
  kube-apiserver bootstraps (`system:kube-controller-manager`, `system:kube-scheduler`);
- `apiserver-kubelet-client`: what kube-apiserver shows a kubelet when it proxies logs;
- `gke-cloud`: what GKE does that no kubelet does (deleting a reclaimed node's object,
  maintenance labels and taints, the maintenance handler's pod deletions on a real node, the
  autoscaler's events), with a role of its own, as GKE's
  own controllers have theirs;
- `cluster-dns`: the names pods resolve (CoreDNS for real nodes, `clusterdns.py`), with the
  read access CoreDNS's `system:coredns` role gives it;
- `simulated-kubelet`: the one identity of all simulated nodes (`simulator/`, benches only),
  as kwok's controller has one (its nodes run no processes and mount no volumes).
Real nodes are not here: each gets `system:node:NAME` in `system:nodes` when it starts
(`node_identity`, `realnode.py`), so the Node authorizer and NodeRestriction treat it as a
kubelet.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import aiohttp

RBAC = "rbac.authorization.k8s.io/v1"
NODE_GROUP = "system:nodes"


@dataclasses.dataclass(frozen=True)
class Identity:
    name: str  # file names under the PKI directory
    common_name: str  # the user
    organizations: tuple[str, ...] = ()  # the groups


ADMIN = Identity("admin", "tardigrade-admin", ("system:masters",))
CONTROLLER_MANAGER = Identity("kube-controller-manager", "system:kube-controller-manager")
SCHEDULER = Identity("kube-scheduler", "system:kube-scheduler")
APISERVER_KUBELET_CLIENT = Identity("apiserver-kubelet-client", "kube-apiserver-kubelet-client")
CLOUD = Identity("gke-cloud", "local:gke-cloud")
CLUSTER_DNS = Identity("cluster-dns", "local:cluster-dns")
SIMULATED_KUBELET = Identity("simulated-kubelet", "local:simulated-kubelet")
# A real node's kube-proxy (kubeproxy.py): the user of kube-apiserver's bootstrap binding
# `system:node-proxier`, so it needs no role of ours.
KUBE_PROXY = Identity("kube-proxy", "system:kube-proxy")
# A real node's NetworkPolicy enforcer (netpolicy.py), with upstream's `kube-router` role.
KUBE_ROUTER = Identity("kube-router", "local:kube-router")
CLIENTS = (ADMIN, CONTROLLER_MANAGER, SCHEDULER, APISERVER_KUBELET_CLIENT, CLOUD, CLUSTER_DNS,
           SIMULATED_KUBELET)


def node_identity(node: str) -> Identity:
    """A kubelet's, as its bootstrap gives it (Kubernetes docs, "Using Node Authorization")."""
    return Identity(f"node-{node}", f"system:node:{node}", (NODE_GROUP,))


def _rule(groups: list[str], resources: list[str], verbs: list[str]) -> dict[str, Any]:
    return {"apiGroups": groups, "resources": resources, "verbs": verbs}


READ = ["get", "list", "watch"]
ROLES: dict[Identity, list[dict[str, Any]]] = {
    CLOUD: [
        _rule([""], ["nodes"], [*READ, "patch", "update", "delete"]),
        # GKE's maintenance handler terminates a node's pods at the start of its host
        # maintenance (hostmaintenance.py).
        _rule([""], ["pods"], [*READ, "delete"]),
        _rule(["", "events.k8s.io"], ["events"], ["create", "patch", "update"]),
        # GKE's queued provisioning (gke/provisioning.py): the cluster autoscaler reads
        # ProvisioningRequests and their PodTemplates and answers in their status.
        _rule(["autoscaling.x-k8s.io"], ["provisioningrequests"], READ),
        _rule(["autoscaling.x-k8s.io"], ["provisioningrequests/status"], ["patch", "update"]),
        _rule([""], ["podtemplates"], READ),
    ],
    CLUSTER_DNS: [  # CoreDNS's system:coredns ClusterRole, plus pods for hostnames
        _rule([""], ["pods", "services", "namespaces"], ["list", "watch"]),
        _rule(["discovery.k8s.io"], ["endpointslices"], ["list", "watch"]),
    ],
    KUBE_ROUTER: [  # kube-router v2.1.0's ClusterRole (daemonset/generic-kuberouter.yaml)
        _rule([""], ["namespaces", "pods", "services", "nodes", "endpoints"], READ),
        _rule(["networking.k8s.io", "extensions"], ["networkpolicies"], READ),
        _rule(["coordination.k8s.io"], ["leases"], ["get", "create", "update"]),
        _rule([""], ["services/status"], ["update"]),
        _rule(["discovery.k8s.io"], ["endpointslices"], READ),
    ],
    SIMULATED_KUBELET: [
        _rule([""], ["nodes"], [*READ, "create", "patch", "update", "delete"]),
        _rule([""], ["nodes/status", "pods/status"], ["patch", "update"]),
        _rule([""], ["pods"], [*READ, "delete", "patch"]),
        _rule([""], ["services"], READ),
        # A simulated rank reads its env as a kubelet does (the job's keys come from a Secret
        # through secretKeyRef); one identity for every simulated node cannot be held to the
        # node authorizer's "only what a pod bound here references", so it may get any.
        _rule([""], ["secrets", "configmaps"], ["get"]),
        _rule(["", "events.k8s.io"], ["events"], ["create", "patch", "update"]),
        _rule(["coordination.k8s.io"], ["leases"], [*READ, "create", "update", "patch"]),
    ],
}

# What the audit log records (`--audit-policy-file`): every request of a client that is not
# the control plane itself, a kubelet or the administrator, at Metadata level (user, verb,
# resource, the authorization decision and its reason, the response code). Tests read it to
# list what an operator was allowed and refused.
AUDIT_POLICY: dict[str, Any] = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "users": [ADMIN.common_name, CONTROLLER_MANAGER.common_name,
                                    SCHEDULER.common_name, "system:apiserver",
                                    CLUSTER_DNS.common_name, SIMULATED_KUBELET.common_name,
                                    KUBE_PROXY.common_name, KUBE_ROUTER.common_name]},
        {"level": "None", "userGroups": [NODE_GROUP, "system:serviceaccounts:kube-system"]},
        {"level": "None", "nonResourceURLs": ["/healthz*", "/readyz*", "/livez*", "/version"]},
        {"level": "Metadata"},
    ],
}


# Our identities bound to roles kube-apiserver bootstraps itself: its own kubelet client
# gets `system:kubelet-api-admin`, the role made for it, or a real kubelet's webhook
# authorizer refuses its `nodes/proxy` (logs, exec) requests.
BOOTSTRAP_ROLE_BINDINGS = ((APISERVER_KUBELET_CLIENT, "system:kubelet-api-admin"),)


def _binding(name: str, role: str, user: str) -> tuple[str, dict[str, Any]]:
    return ("clusterrolebindings", {
        "apiVersion": RBAC, "kind": "ClusterRoleBinding", "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": role},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]})


def _objects() -> list[tuple[str, dict[str, Any]]]:
    objects = [_binding(f"{identity.common_name}:{role}", role, identity.common_name)
               for identity, role in BOOTSTRAP_ROLE_BINDINGS]
    for identity, rules in ROLES.items():
        name = identity.common_name
        objects.append(("clusterroles", {"apiVersion": RBAC, "kind": "ClusterRole",
                                         "metadata": {"name": name}, "rules": rules}))
        objects.append(_binding(name, name, name))
    return objects


async def install(session: aiohttp.ClientSession, api_url: str) -> None:
    """Create our identities' ClusterRoles and bindings (as the admin); present ones stay."""
    for plural, body in _objects():
        async with session.post(f"{api_url}/apis/{RBAC}/{plural}", json=body) as resp:
            if resp.status not in (201, 409):
                raise RuntimeError(f"cannot create {plural} {body['metadata']['name']}: "
                                   f"{await resp.text()}")
