"""The operator's RBAC grants, each with the call that needs it, and how to check them.

`GRANTS` is the one table: a grant in the chart that is not here, or a row here the chart
does not grant, fails `test_rbac_grants.py`; the chart e2e tests run the operator from its
image under the chart's ServiceAccount in a local cluster of real nodes (RBAC and
OwnerReferencesPermissionEnforcement on) and fail on any denial. Later work adds its rows
here and its rules to `charts/tardigrade/templates/rbac.yaml` together.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

# Rendered configurations of the chart (helm --set values) the table is checked against.
ALL_NAMESPACES = "all-namespaces"
NAMESPACED = "namespaced"
STANDALONE = "standalone"
CONFIGS: dict[str, tuple[str, ...]] = {
    ALL_NAMESPACES: (),
    NAMESPACED: ("watch.allNamespaces=false", "watch.namespaces={ml,lab}"),
    STANDALONE: ("leaderElection.enabled=false",),
}
EVERY = frozenset(CONFIGS)
CLUSTER_WIDE = frozenset({ALL_NAMESPACES, STANDALONE})
PEERING_ALL = frozenset({ALL_NAMESPACES})
PEERING_NS = frozenset({NAMESPACED})
NAMESPACE_LIST = frozenset({NAMESPACED})

# Where a grant applies: "cluster" always cluster-wide (ClusterRole + ClusterRoleBinding);
# "jobs" where TrainingJobs are watched (cluster-wide, or a Role in each watched namespace).
CLUSTER = "cluster"
JOBS = "jobs"


@dataclass(frozen=True)
class Grant:
    group: str
    resource: str  # "pods" or "trainingjobs/status"
    verb: str
    scope: str
    configs: frozenset[str]
    needed_by: str


KOPF_CRDS = "kopf's resource observer lists and watches CRDs to resolve the kinds it serves"
KOPF_NS = ("kopf's namespace observer lists and watches namespaces when the operator serves "
           "a list of them (not with --all-namespaces)")
NODES = ("node readiness, host maintenance and node pool indexes (handlers.py `node_readiness`, "
         "`node_maintenance`, `node_pool`: a TPU slice leader's pool for its followers; "
         "TARDIGRADE_WATCH_NODES); a ClusterRole of its own in namespaced "
         "mode, as kopf watches the cluster-scoped kind cluster-wide")
PEERING = "kopf peering: watches the peering object and patches its keepalive into it"
TOKEN_REVIEW_SUBJECTS = ("kube.Writer.grant_token_review (tokenreview_access.py): a job's "
                         "namespace and ServiceAccount added to the trainers' TokenReview "
                         "binding before its pods, cluster-wide only (resourceNames: that "
                         "binding)")
TJ = "tardigrade.dev"
KUEUE = "kueue.x-k8s.io"

GRANTS: list[Grant] = [
    Grant("apiextensions.k8s.io", "customresourcedefinitions", "list", CLUSTER, EVERY,
          KOPF_CRDS),
    Grant("apiextensions.k8s.io", "customresourcedefinitions", "watch", CLUSTER, EVERY,
          KOPF_CRDS),
    Grant("", "namespaces", "list", CLUSTER, NAMESPACE_LIST, KOPF_NS),
    Grant("", "namespaces", "watch", CLUSTER, NAMESPACE_LIST, KOPF_NS),
    Grant("", "nodes", "list", CLUSTER, EVERY, NODES),
    Grant("", "nodes", "watch", CLUSTER, EVERY, NODES),
    Grant("kopf.dev", "clusterkopfpeerings", "list", CLUSTER, PEERING_ALL, PEERING),
    Grant("kopf.dev", "clusterkopfpeerings", "watch", CLUSTER, PEERING_ALL, PEERING),
    Grant("kopf.dev", "clusterkopfpeerings", "patch", CLUSTER, PEERING_ALL, PEERING),
    Grant("kopf.dev", "kopfpeerings", "list", JOBS, PEERING_NS, PEERING),
    Grant("kopf.dev", "kopfpeerings", "watch", JOBS, PEERING_NS, PEERING),
    Grant("kopf.dev", "kopfpeerings", "patch", JOBS, PEERING_NS, PEERING),
    Grant(TJ, "trainingjobs", "list", JOBS, EVERY, "kopf index, event and daemon handlers"),
    Grant(TJ, "trainingjobs", "watch", JOBS, EVERY, "kopf index, event and daemon handlers"),
    Grant(TJ, "trainingjobs", "patch", JOBS, EVERY,
          "kopf removes the finalizer `tardigrade.dev/operator` that older operator versions "
          "gave jobs (handlers.py JOB_FINALIZER)"),
    Grant(TJ, "trainingjobs", "get", JOBS, EVERY,
          "kube.Writer.read_job: the daemon's fresh read, and release_orphan's owner check"),
    Grant(TJ, "trainingjobs/status", "patch", JOBS, EVERY, "kube.Writer.apply: status patch"),
    Grant(TJ, "trainingjobs/finalizers", "update", JOBS, EVERY,
          "pods and the service carry a blockOwnerDeletion ownerReference to the job "
          "(rendering/manifests.py); OwnerReferencesPermissionEnforcement (OpenShift) requires "
          "this"),
    Grant("", "pods", "list", JOBS, EVERY, "kopf pod index and event handler; list_job_pods"),
    Grant("", "pods", "watch", JOBS, EVERY, "kopf pod index and event handler"),
    Grant("", "pods", "create", JOBS, EVERY, "kube.Writer.apply: the gang's pods"),
    Grant("", "pods", "delete", JOBS, EVERY,
          "kube.Writer.delete_pod (stopping an attempt); also what "
          "OwnerReferencesPermissionEnforcement asks of a creator that sets an ownerReference"),
    Grant("", "pods", "get", JOBS, EVERY, "kube.Writer.release_pod reads the pod's finalizers"),
    Grant("", "pods", "patch", JOBS, EVERY,
          "kube.Writer.release_pod: JSON patch that drops the gang-tracking finalizer; "
          "kube.Writer.patch_pod: a kept pod's new attempt label and world annotation "
          "(restart in place)"),
    Grant("", "services", "list", JOBS, EVERY,
          "kopf service index; kube.Writer.read_service (a fieldSelector on the name: who owns "
          "a Service with the job's name, which a user's Service lacks the label to be indexed)"),
    Grant("", "services", "watch", JOBS, EVERY, "kopf service index"),
    Grant("", "services", "create", JOBS, EVERY, "kube.Writer.apply: the gang's headless service"),
    Grant("", "services", "delete", JOBS, EVERY,
          "never called: OwnerReferencesPermissionEnforcement asks it of a creator that sets "
          "an ownerReference (\"cannot set an ownerRef on a resource you can't delete\")"),
    Grant("networking.k8s.io", "networkpolicies", "create", JOBS, EVERY,
          "kube.Writer.apply: the job's NetworkPolicy (netpolicy.py), created with the Service "
          "and again whenever it went missing"),
    Grant("networking.k8s.io", "networkpolicies", "list", JOBS, EVERY,
          "kopf NetworkPolicy index and event handler (handlers.py `gang_policies`, "
          "`isolation_changed`): a job's policy that went missing is made again"),
    Grant("networking.k8s.io", "networkpolicies", "watch", JOBS, EVERY,
          "kopf NetworkPolicy index and event handler (handlers.py `gang_policies`)"),
    Grant("", "secrets", "create", JOBS, EVERY,
          "kube.Writer.apply: the job's keys Secret (keys.py), before its pods, and again "
          "whenever it went missing"),
    Grant("", "secrets", "get", JOBS, EVERY,
          "kube.Writer.read_secret: the job's keys Secret by name (observe.job_keys_of: its "
          "owner, the restart key for restart requests, the progress token for polls); no list "
          "or watch, which would expose every Secret of the namespace to the operator"),
    Grant("", "secrets", "delete", JOBS, EVERY,
          "never called: OwnerReferencesPermissionEnforcement asks it of a creator that sets "
          "an ownerReference (the Secret is owned by its TrainingJob)"),
    Grant("networking.k8s.io", "networkpolicies", "delete", JOBS, EVERY,
          "never called: OwnerReferencesPermissionEnforcement asks it of a creator that sets "
          "an ownerReference (the policy is owned by its TrainingJob)"),
    Grant("", "events", "create", JOBS, EVERY, "kopf.event / kopf's event posting"),
    Grant("", "events", "list", JOBS, EVERY,
          "kube.Writer.list_scale_up_events: the autoscaler's TriggeredScaleUp / "
          "NotTriggerScaleUp / FailedScaleUp on unschedulable ranks (observe._scale_up_signals)"),
    Grant(KUEUE, "workloads", "list", JOBS, EVERY, "kopf Workload index and event handler"),
    Grant(KUEUE, "workloads", "watch", JOBS, EVERY, "kopf Workload index and event handler"),
    Grant(KUEUE, "workloads", "create", JOBS, EVERY,
          "kube.Writer.apply_workload: a queued job's Workload (queueing.CreateWorkload)"),
    Grant(KUEUE, "workloads", "get", JOBS, EVERY,
          "kube.Writer.apply_workload reads the Workload before a resize or a status write"),
    Grant(KUEUE, "workloads", "update", JOBS, EVERY,
          "kube.Writer.apply_workload: a queued job's new podSet count (ResizeWorkload)"),
    Grant(KUEUE, "workloads", "delete", JOBS, EVERY,
          "kube.Writer.apply_workload: a running job resized drops the Workload admitted at "
          "its old count once the gang stopped (DeleteWorkload); also what "
          "OwnerReferencesPermissionEnforcement asks of an ownerReference's setter"),
    Grant(KUEUE, "workloads/status", "update", JOBS, EVERY,
          "kube.Writer.apply_workload: conditions the job side sets (quota released after an "
          "eviction, Finished)"),
    Grant(KUEUE, "resourceflavors", "list", CLUSTER, EVERY,
          "kopf ResourceFlavor index: an admitted flavor's node labels (handlers.py)"),
    Grant(KUEUE, "resourceflavors", "watch", CLUSTER, EVERY,
          "kopf ResourceFlavor index: an admitted flavor's node labels (handlers.py)"),
    Grant(KUEUE, "workloadpriorityclasses", "get", CLUSTER, EVERY,
          "kube.Writer.priority_value: a queued job's kueue.x-k8s.io/priority-class"),
    # Only the trainers' TokenReview binding and its role (resourceNames), cluster-wide only.
    Grant("rbac.authorization.k8s.io", "clusterrolebindings", "get", CLUSTER, CLUSTER_WIDE,
          TOKEN_REVIEW_SUBJECTS),
    Grant("rbac.authorization.k8s.io", "clusterrolebindings", "update", CLUSTER, CLUSTER_WIDE,
          TOKEN_REVIEW_SUBJECTS),
    Grant("rbac.authorization.k8s.io", "clusterroles", "bind", CLUSTER, CLUSTER_WIDE,
          "RBAC's escalation check on kube.Writer.grant_token_review's update: whoever updates "
          "a binding needs bind on its role (the trainers' TokenReview role, by resourceName)"),
]



def expected_grants(config: str, namespaces: tuple[str, ...] = ("ml", "lab")
                    ) -> set[tuple[str, str, str, str]]:
    """(where, group, resource, verb) the table gives `config`; where: "cluster" or "ns:x"."""
    out = set()
    for g in GRANTS:
        if config not in g.configs:
            continue
        wheres = ["cluster"] if g.scope == CLUSTER or config != NAMESPACED else [
            f"ns:{ns}" for ns in namespaces]
        out |= {(w, g.group, g.resource, g.verb) for w in wheres}
    return out


def rendered_grants(docs: list[dict[str, Any]], account: str, account_namespace: str
                    ) -> set[tuple[str, str, str, str]]:
    """(where, group, resource, verb) the rendered chart grants the ServiceAccount."""
    roles = {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    out = set()
    for binding in docs:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == account
                   and s.get("namespace") == account_namespace
                   for s in binding.get("subjects") or []):
            continue
        namespace = binding["metadata"].get("namespace", "")
        ref = binding["roleRef"]
        role = roles[(ref["kind"], namespace if ref["kind"] == "Role" else "", ref["name"])]
        where = f"ns:{namespace}" if binding["kind"] == "RoleBinding" else "cluster"
        for rule in role.get("rules") or []:
            out |= {(where, group, resource, verb) for group in rule.get("apiGroups") or []
                    for resource in rule.get("resources") or [] for verb in rule["verbs"]}
    return out


def audited_calls(audit_log: Path, user: str, since: datetime | None = None
                  ) -> list[dict[str, Any]]:
    """kube-apiserver's audit events for `user` (Metadata level: the request, the
    authorization decision and the response code; local_cluster/README.md, "Audit log"),
    received at `since` or later (None: all)."""
    events = [json.loads(line) for line in audit_log.read_text().splitlines() if line]
    return [e for e in events if e["user"]["username"] == user and (
        since is None or received(e) >= since)]


def received(event: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))


def call_key(event: dict[str, Any]) -> tuple[str, str, str]:
    ref = event.get("objectRef") or {}
    resource = ref.get("resource", event.get("requestURI", ""))
    if ref.get("subresource"):
        resource += "/" + ref["subresource"]
    return ref.get("apiGroup", ""), resource, event["verb"]


# OwnerReferencesPermissionEnforcement maps an owner's kind with kube-apiserver's admission
# RESTMapper, which reloads discovery every 30 s (`discoveryRESTMapper.Reset` on a 30 s
# timer, k8s.io/kubernetes pkg/kubeapiserver/admission/config.go). For up to 30 s after the
# chart installs the CRD, an owner reference to a TrainingJob is refused with this message:
# a lag of the server's, not a missing grant, once the same call succeeds later.
RESTMAPPER_LAG = "cannot find RESTMapping for APIVersion tardigrade.dev/"


def _call_of(event: dict[str, Any]) -> tuple[str, str, str, str, str]:
    ref = event.get("objectRef") or {}
    return (*call_key(event), ref.get("namespace", ""), ref.get("name", ""))


def _succeeded_later(event: dict[str, Any], events: list[dict[str, Any]]) -> bool:
    return any(_call_of(later) == _call_of(event) and received(later) > received(event)
               and (later.get("responseStatus") or {}).get("code", 500) < 400
               for later in events)


def denials(events: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in events:
        notes = e.get("annotations") or {}
        code = (e.get("responseStatus") or {}).get("code")
        # Refused by RBAC (decision "forbid"), or allowed by RBAC and then refused by an
        # admission plugin that authorizes on its own (OwnerReferencesPermissionEnforcement:
        # a 403 whose message says why).
        if notes.get("authorization.k8s.io/decision") == "allow" and code != 403:
            continue
        if RESTMAPPER_LAG in (e.get("responseStatus") or {}).get("message", "") \
                and _succeeded_later(e, events):
            continue
        group, resource, verb = call_key(e)
        where = (e.get("objectRef") or {}).get("namespace", "")
        why = (e.get("responseStatus") or {}).get("message", "")
        out.append(f"{verb} {resource} in API group {group!r}"
                   + (f" in {where}" if where else "") + (f": {why}" if why else ""))
    return sorted(set(out))


def check_operator_calls(audit_log: Path, account: str, namespace: str,
                         config: str, since: datetime | None = None
                         ) -> set[tuple[str, str, str]]:
    """Fail on any denial of the operator's ServiceAccount, or a call outside the table;
    returns the (group, resource, verb) it used. `since`: only the calls from then on (one
    install of the chart where the cluster saw others before)."""
    calls = audited_calls(audit_log, f"system:serviceaccount:{namespace}:{account}", since)
    assert calls, f"no request of {account} reached the API server (audit log {audit_log})"
    denied = denials(calls)
    assert not denied, "the operator was denied:\n" + "\n".join(denied)
    used = {call_key(e) for e in calls if (e.get("objectRef") or {})}
    table = {(g.group, g.resource, g.verb) for g in GRANTS if config in g.configs}
    assert used <= table, f"calls missing from GRANTS: {sorted(used - table)}"
    return used
