"""The per-job NetworkPolicy: who may connect to a gang's pods.

Ingress to the trainer pods is limited to
- the gang's own pods, on every port: the rendezvous/coordinator (8476) and progress ports,
  and the collectives (gloo on CPU, NCCL on GPU) that listen on ephemeral ports;
- the operator's pods, on the progress port (it polls /progress);
- the metrics scraper the chart names (namespace and pod selectors), on the progress port
  (rank 0 serves /metrics there).
Egress is left open (checkpoint storage, the API server, DNS). A policy only takes effect where
the network plugin enforces NetworkPolicy (on GKE: Dataplane V2, or network policy enforcement
turned on). Without that, any pod of the cluster reaches all of the above. Only two of them
check who calls: the rendezvous on 8476 (the hello carries a reviewed service-account token,
trainer distributed.py) and POST /restart-in-place (the pod's restart key); GET /progress does
when the job has a progress token. Once the gang has met, 8476 is JAX's coordination service,
which checks nothing: any caller can read and write its key-value store and barriers, and so
disturb or stop the gang. /metrics and the collectives' ports are open as well.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tardigrade_contract import contract

from tardigrade_operator import naming
from tardigrade_operator.rendering.manifests import JobRef

# Set on every namespace by the API server (NamespaceDefaultLabelName, 1.21+).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


@dataclasses.dataclass(frozen=True)
class NetworkPeers:
    """Who besides the gang may reach it (operator settings, from the chart)."""

    operator_namespace: str | None = None
    operator_pod_labels: dict[str, str] = dataclasses.field(default_factory=dict)
    # LabelSelectors (matchLabels/matchExpressions) of the metrics scraper, e.g. Prometheus.
    scraper_namespace_selector: dict[str, Any] | None = None
    scraper_pod_selector: dict[str, Any] | None = None


def policy_name(job: str) -> str:
    return f"{job}-gang"


def gang_selector(job: str) -> dict[str, Any]:
    return {"matchLabels": {naming.LABEL_JOB: job, naming.LABEL_MANAGED_BY: naming.MANAGED_BY}}


def build_network_policy(job: JobRef, peers: NetworkPeers) -> dict[str, Any]:
    progress = [{"protocol": "TCP", "port": contract.DEFAULT_PROGRESS_PORT}]
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": gang_selector(job.name)}]}]
    if peers.operator_namespace and peers.operator_pod_labels:
        ingress.append({"from": [{
            "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: peers.operator_namespace}},
            "podSelector": {"matchLabels": dict(peers.operator_pod_labels)},
        }], "ports": progress})
    if peers.scraper_namespace_selector is not None or peers.scraper_pod_selector is not None:
        scraper: dict[str, Any] = {}
        if peers.scraper_namespace_selector is not None:
            scraper["namespaceSelector"] = peers.scraper_namespace_selector
        if peers.scraper_pod_selector is not None:
            scraper["podSelector"] = peers.scraper_pod_selector
        ingress.append({"from": [scraper], "ports": progress})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": policy_name(job.name),
            "namespace": job.namespace,
            "labels": {naming.LABEL_MANAGED_BY: naming.MANAGED_BY, naming.LABEL_JOB: job.name},
            "ownerReferences": [job.owner_reference()],
        },
        "spec": {
            "podSelector": gang_selector(job.name),
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
