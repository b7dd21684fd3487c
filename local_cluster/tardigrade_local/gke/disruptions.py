"""Disruptions the way clouds and Kubernetes cause them: names, reasons and messages.

The kubelet and pod GC write these onto pods exactly as the real components do, so the
operator's classification (preempted / evicted / node lost / crashed) is tested against the
real wire format:
- spot reclaim / node shutdown: the node's kubelet sets DisruptionTarget
  (TerminationByKubelet), SIGTERMs, waits the grace period, SIGKILLs; pods end Failed with
  `status.reason: Terminated`; then the Node object disappears. The grace is the shutdown
  grace for regular pods, or the pod's own terminationGracePeriodSeconds if smaller
  (`node_shutdown_pod_grace`);
- node lost: the processes die without notice, the Node object is deleted, pod GC marks the
  pods Failed with DisruptionTarget (DeletionByPodGC) and deletes them;
- Eviction API: the API server adds DisruptionTarget (EvictionByEvictionAPI) and deletes the
  pod with its grace period; the kubelet reacts to the deletion;
- a crash: the container's process dies on its own (SIGKILL: exit code 137, reason Error);
- scheduled host maintenance (GKE GPU/TPU nodes, which cannot live-migrate): the node is
  labelled with the start time ahead; at that time it is tainted, its pods are terminated
  with their own grace period (up to an hour on GPU VMs) and the VM comes back under its name;
- control plane: the API server restarts (every connection drops, the port refuses
  connections for a while, objects and resourceVersions survive as in etcd, watches resumed
  from before get 410 Gone), or every open watch connection is cut at once.

`Disruptor` drives them from outside the cluster process, through its control endpoint.
"""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from typing import Any

DISRUPTION_TARGET = "DisruptionTarget"
REASON_TERMINATION_BY_KUBELET = "TerminationByKubelet"
REASON_DELETION_BY_POD_GC = "DeletionByPodGC"
REASON_EVICTION_BY_EVICTION_API = "EvictionByEvictionAPI"
REASON_DELETION_BY_TAINT_MANAGER = "DeletionByTaintManager"

# What kube-controller-manager writes on a node whose Lease went unrenewed, and the taints it
# and pod GC act on (pkg/controller/nodelifecycle/node_lifecycle_controller.go,
# `tryUpdateNodeHealth`; k8s.io/api/core/v1 well_known_taints.go).
TAINT_UNREACHABLE = "node.kubernetes.io/unreachable"
TAINT_NOT_READY = "node.kubernetes.io/not-ready"
TAINT_OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"
NODE_STATUS_UNKNOWN = "NodeStatusUnknown"
NODE_STATUS_UNKNOWN_MESSAGE = "Kubelet stopped posting node status."

NODE_SHUTDOWN_REASON = "Terminated"
NODE_SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."
NODE_SHUTDOWN_NODE_MESSAGE = "node is shutting down"
POD_GC_MESSAGE = "PodGC: node no longer exists"
EVICTION_MESSAGE = "Eviction API: evicting"


# The kubelet's graceful node shutdown as GKE configures it for spot VMs: a 30 s notice
# (shutdownGracePeriod), of which the last 15 s are for critical system pods
# (shutdownGracePeriodCriticalPods). pkg/kubelet/nodeshutdown/nodeshutdown_manager.go,
# migrateConfig, turns the two into a group of regular pods with 30 - 15 = 15 s and one of
# critical pods with 15 s; GKE "Spot VMs" concept page ("Termination and graceful shutdown of
# Spot VMs"; node pools can opt in to a longer window, up to 120 s, on 1.35.0-gke.1171000+).
SHUTDOWN_GRACE_PERIOD_SECONDS = 30.0
SHUTDOWN_GRACE_PERIOD_CRITICAL_PODS_SECONDS = 15.0
REGULAR_POD_SHUTDOWN_GRACE_SECONDS = (
    SHUTDOWN_GRACE_PERIOD_SECONDS - SHUTDOWN_GRACE_PERIOD_CRITICAL_PODS_SECONDS
)


def node_shutdown_pod_grace(pod_grace: float | None, group_grace: float) -> float:
    """Seconds between SIGTERM and SIGKILL for a pod on a node that shuts down.

    `podManager.killPods` (nodeshutdown_manager.go): the grace of the pod's priority group,
    unless the pod's terminationGracePeriodSeconds is set and not larger. Every pod the local
    cluster runs is a regular pod (no system-cluster-critical priority), so `group_grace` is
    the regular pods' share.
    """
    if pod_grace is not None and pod_grace <= group_grace:
        return float(pod_grace)
    return float(group_grace)


# Scheduled host maintenance of GPU/TPU nodes, as GKE announces and performs it (GKE "Monitor
# maintenance events": from 1.31.1-gke.2008000 on, GPU/TPU nodes get the label while the
# maintenance is upcoming and not yet active, its value the start as Unix epoch seconds; "Manage
# AI-optimized GKE clusters": GPUs and TPUs do not live-migrate, so GKE terminates the node and
# its Pods). The NoSchedule taint at the start is what GKE's maintenance handler applies
# (`--taint=cloud.google.com/impending-node-termination::NoSchedule`, with a 1 h timeout for
# regular GPU VMs: `--regular-vm-timeout=1h0m0s`, as its DaemonSet arguments read on a GKE
# node); the pods get their own terminationGracePeriodSeconds, at most that hour.
SCHEDULED_MAINTENANCE_LABEL = "cloud.google.com/scheduled-maintenance-time"
IMPENDING_TERMINATION_TAINT = "cloud.google.com/impending-node-termination"
MAINTENANCE_POD_GRACE_SECONDS = 3600.0
MAINTENANCE_MESSAGE = "Node is shutting down (scheduled host maintenance)"

# A GKE node pool is a Compute Engine managed instance group; the MIG recreates a preempted
# Spot VM, under the same instance (and so node) name, "when resources become available"
# (Compute Engine "Create a MIG that uses preemptible VMs"; MIG repair: the group retries until
# the VM is created). No delay is promised: this default is a local stand-in (a VM boot plus
# kubelet registration is tens of seconds), short of the operator's 60 s unschedulable timeout
# so a replaced node is back before an elastic job would shrink.
DEFAULT_REPLACE_AFTER_SECONDS = 20.0


class DisruptionError(RuntimeError):
    pass


class Disruptor:
    """Client of the cluster process's control endpoint (`cluster.json: control_url`)."""

    def __init__(self, control_url: str) -> None:
        self.control_url = control_url.rstrip("/")

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.control_url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            raise DisruptionError(err.read().decode(errors="replace") or str(err)) from None

    def preempt_node(self, node: str, grace_seconds: float | None = None,
                     replace_after_seconds: float | None = None, wait: bool = False) -> Any:
        """Spot reclaim: returns at once unless `wait` (then when the Node is gone)."""
        return self._call("POST", f"/nodes/{node}/preempt", {
            "graceSeconds": grace_seconds, "replaceAfterSeconds": replace_after_seconds,
            "wait": wait})

    def preempt_pod(self, namespace: str, pod: str, grace_seconds: float | None = None,
                    replace_after_seconds: float | None = None, wait: bool = False) -> Any:
        """Reclaim the VM that runs this pod (clouds preempt machines, not pods)."""
        return self._call("POST", f"/pods/{namespace}/{pod}/preempt", {
            "graceSeconds": grace_seconds, "replaceAfterSeconds": replace_after_seconds,
            "wait": wait})

    def halt_node(self, node: str, back_after_seconds: float | None = None,
                  wait: bool = False) -> Any:
        """The VM stops without a shutdown: processes freeze, the kubelet goes silent, the Node
        object stays (Unknown after the node monitor grace period); with `back_after_seconds`
        the VM boots again under the same name. `wait`: return once it is back."""
        return self._call("POST", f"/nodes/{node}/halt", {
            "backAfterSeconds": back_after_seconds, "wait": wait})

    def schedule_maintenance(self, node: str, in_seconds: float,
                             back_after_seconds: float | None = None) -> Any:
        """GKE host maintenance: the node is labelled with its start at once; at the start it
        is tainted and shut down with the pods' own grace; the VM comes back under its name
        after `back_after_seconds` (default: the cluster's replacement delay)."""
        return self._call("POST", f"/nodes/{node}/maintenance", {
            "inSeconds": in_seconds, "backAfterSeconds": back_after_seconds})

    def partition_node(self, node: str, seconds: float, wait: bool = False) -> Any:
        """The kubelet cannot reach the control plane for `seconds` (partition, kubelet
        restart): the node turns Unknown after the node monitor grace period while its pods
        run on; then Ready again. `wait`: return once it is over."""
        return self._call("POST", f"/nodes/{node}/partition", {"seconds": seconds,
                                                               "wait": wait})

    def delete_node(self, node: str) -> Any:
        """Node lost: processes die at once, the Node object is deleted."""
        return self._call("DELETE", f"/nodes/{node}")

    def add_node(self, name: str, labels: dict[str, str] | None = None,
                 taints: list[dict[str, str]] | None = None,
                 capacity: dict[str, str] | None = None) -> Any:
        return self._call("POST", "/nodes", {"name": name, "labels": labels or {},
                                             "taints": taints or [], "capacity": capacity or {}})

    def crash_pod(self, namespace: str, pod: str, container: str | None = None,
                  sig: int = signal.SIGKILL) -> Any:
        return self._call("POST", f"/pods/{namespace}/{pod}/crash",
                          {"container": container, "signal": int(sig)})

    def restart_apiserver(self, downtime_seconds: float = 0.0,
                          expire_history: bool = True) -> Any:
        """Returns once the API server serves again (after `downtime_seconds`)."""
        return self._call("POST", "/apiserver/restart", {
            "downtimeSeconds": downtime_seconds, "expireHistory": expire_history})

    def cut_watches(self, expire_history: bool = False) -> Any:
        """Drop every open watch connection; `{"cut": N}`."""
        return self._call("POST", "/apiserver/cut-watches", {"expireHistory": expire_history})

    def status(self) -> Any:
        return self._call("GET", "/status")
