"""GKE's scheduled host maintenance of a GPU/TPU node: the part GKE plays, for the real nodes
(`realreclaim.py`, `realcluster.py`) and the benches' simulated ones (`simulator/host.py`).

What GKE does (sources in `disruptions.py` and local_cluster/README.md, "Scheduled host
maintenance"):
- `announce`: the node is labelled `cloud.google.com/scheduled-maintenance-time` with the
  start, Unix epoch seconds, while the maintenance is upcoming;
- `begin`: at the start, GKE's node maintenance handler taints the node
  `cloud.google.com/impending-node-termination:NoSchedule`;
- `drain` (real nodes): the handler terminates the node's pods with their own
  terminationGracePeriodSeconds, at most its timeout for regular GPU VMs (1 h); the kubelet's
  graceful node shutdown, which follows when the VM shuts down, gives a pod at most the
  shutdownGracePeriod GKE configures for every node (15 s for regular pods), so the longer
  grace of a maintenance is the handler's. It deletes the pods as GCP's documented
  predecessor of that handler did (k8s-node-termination-handler: taint the node, delete the
  pods outside kube-system first, those in it last), then waits for them to be gone.
The VM's shutdown and return are each kind of node's own (`RealNode.shutdown` and
`RealNodeCluster`'s recreation; `SimulatedHost.preempt_node`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from typing import Any

from tardigrade_local.gke.client import ApiError, core_path
from tardigrade_local.gke.cloud import GkeCloud
from tardigrade_local.gke.disruptions import (
    IMPENDING_TERMINATION_TAINT,
    MAINTENANCE_POD_GRACE_SECONDS,
    SCHEDULED_MAINTENANCE_LABEL,
)

IMPENDING_TERMINATION = {"key": IMPENDING_TERMINATION_TAINT, "effect": "NoSchedule"}
# What Kubernetes gives a pod that sets no terminationGracePeriodSeconds.
DEFAULT_POD_GRACE_SECONDS = 30
SYSTEM_NAMESPACE = "kube-system"
DRAIN_POLL_SECONDS = 0.5
# Past the longest grace, for the kubelet to report the pods gone on a loaded machine.
DRAIN_MARGIN_SECONDS = 60.0


def start_after(in_seconds: float, now: float | None = None) -> float:
    """The start (epoch seconds) of a maintenance `in_seconds` from now."""
    if in_seconds < 0:
        raise ValueError(f"inSeconds: {in_seconds:g} is in the past; give 0 or more seconds")
    return (time.time() if now is None else now) + in_seconds


def label_value(start: float) -> str:
    """The label's value, as GKE writes it: whole epoch seconds."""
    return str(int(start))


def handler_grace(pod: Mapping[str, Any]) -> int:
    """The grace the maintenance handler gives `pod`: its own terminationGracePeriodSeconds
    (Kubernetes' default where unset), at most the handler's timeout."""
    own = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
    grace = DEFAULT_POD_GRACE_SECONDS if own is None else int(own)
    return max(0, min(grace, int(MAINTENANCE_POD_GRACE_SECONDS)))


def drain_order(pods: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The pods to delete, in the handler's order: those outside kube-system first; a pod
    already being deleted, or finished, is left as it is."""
    left = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
    return sorted(left, key=lambda p: p["metadata"]["namespace"] == SYSTEM_NAMESPACE)


async def announce(cloud: GkeCloud, node: str, in_seconds: float) -> float:
    """Label `node` with the start of its maintenance `in_seconds` from now; returns the
    start."""
    start = start_after(in_seconds)
    await announce_at(cloud, node, start)
    return start


async def announce_at(cloud: GkeCloud, node: str, start: float) -> None:
    """Label `node` with a maintenance starting at `start` (epoch seconds): another host of
    a slice already announced."""
    await cloud.label_node(node, {SCHEDULED_MAINTENANCE_LABEL: label_value(start)})


async def wait_for_start(start: float) -> None:
    await asyncio.sleep(max(0.0, start - time.time()))


async def begin(cloud: GkeCloud, node: str) -> None:
    """The start: the handler taints the node (a node already gone is left alone)."""
    try:
        await cloud.taint_node(node, dict(IMPENDING_TERMINATION))
    except ApiError as err:
        if err.status != 404:
            raise


async def node_pods(cloud: GkeCloud, node: str) -> list[dict[str, Any]]:
    found = await cloud.client.request("GET", core_path("pods"),
                                       params={"fieldSelector": f"spec.nodeName={node}"})
    return list(found.get("items") or [])


async def drain(cloud: GkeCloud, node: str) -> list[str]:
    """Delete the node's pods with the handler's grace and wait until none is left or the
    longest grace (plus a margin) has passed; returns the pods deleted, `namespace/name`."""
    pods = drain_order(await node_pods(cloud, node))
    deleted = []
    for pod in pods:
        meta = pod["metadata"]
        await cloud.client.delete(core_path("pods", meta["namespace"], meta["name"]),
                                  grace_seconds=handler_grace(pod))
        deleted.append(f"{meta['namespace']}/{meta['name']}")
    longest = max((handler_grace(p) for p in pods), default=0)
    deadline = time.monotonic() + min(longest + DRAIN_MARGIN_SECONDS,
                                      MAINTENANCE_POD_GRACE_SECONDS)
    while deleted and time.monotonic() < deadline:
        names = {f"{p['metadata']['namespace']}/{p['metadata']['name']}"
                 for p in await node_pods(cloud, node)}
        if not names & set(deleted):
            break
        await asyncio.sleep(DRAIN_POLL_SECONDS)
    return deleted
