"""A local cluster of real nodes, made and taken down in one place.

`RealNodeCluster` starts, in this order, what a GKE cluster with Tardigrade installed is made
of here: the control plane (`LocalCluster`, with no nodes of its own, node egress on, the endpoint
controllers running, the CRD left to the chart, and the GCS emulator on the host's loopback),
an image registry (`registry.py`) with the operator and trainer-cpu images built
(`imagebuild.py`, a lookup when their inputs are unchanged) and pushed to it, the cluster
network (`nodenet.py`), cluster DNS (`clusterdns.py`), the `kubernetes` Service's endpoint for
pods (`clusterapi.py`), the GCS emulator's Service for pods (`clustergcs.py`: trainers
checkpoint to `gs://GCS_BUCKET/...` with `gcs_pod_env()` in their TrainingJob's `env`;
`gcs=False` leaves the emulator and its Service out), the real nodes (`realnode.py`, each as
its `NodeConfig` says, `nodeshape.py`; spot ones labelled `cloud.google.com/gke-spot=true`, as
GKE does; with `pools=`, the cluster autoscaler, which starts more, and with Kueue GKE's
queued provisioning for the queued-provisioning pools), and a ReadWriteMany
PersistentVolume over one host directory every node mounts, bound to a claim
(`CHECKPOINT_CLAIM`), where trainers may checkpoint instead (a shared filesystem; a claim is
what the chart's admission lets a trainer mount). `install_operator` is `helm install` of the
chart with the registry's operator image. `stop` takes everything down in the reverse order and
leaves nothing on the machine (`leftovers`).

With `kueue=True` the control plane runs Kueue's manager (`kueue.py`) before anything else
starts, so the operator the chart installs serves Workloads from its first pass (it learns
Kueue's kinds at start), and the chart's objects go through Kueue's webhooks as on a GKE
cluster with Kueue installed first.

`tardigrade local up` runs one in a process of its own (`serve`, `python -m
tardigrade_local.realcluster STATE_DIR`), which every process of the cluster dies with; the
real-node tests run one in the test process. Needs root and Linux (`realnode.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO, TypeVar

import kubernetes
import psutil
import urllib3

from tardigrade_local import (
    clustergcs,
    identities,
    imagebuild,
    nodenet,
    nodeshape,
    realnode,
)
from tardigrade_local.cluster import LocalCluster, repo_root
from tardigrade_local.clusterapi import ClusterAPI
from tardigrade_local.clusterdns import ClusterDNS
from tardigrade_local.clustergcs import ClusterGCS
from tardigrade_local.controlplane import NODE_MONITOR_GRACE_SECONDS, NODE_MONITOR_PERIOD_SECONDS
from tardigrade_local.gke import hostmaintenance, realreclaim, tpuslices
from tardigrade_local.gke.autoscaler import SCAN_INTERVAL_SECONDS, NodeAutoscaler, NodePool
from tardigrade_local.gke.client import ApiClient
from tardigrade_local.gke.cloud import GkeCloud
from tardigrade_local.gke.disruptions import DEFAULT_REPLACE_AFTER_SECONDS
from tardigrade_local.gke.nodes import DEFAULT_NODE_CAPACITY, NodeConfig
from tardigrade_local.gke.provisioning import QueuedProvisioner
from tardigrade_local.kueue import WaitForPodsReady
from tardigrade_local.nodenet import ClusterNetwork
from tardigrade_local.paths import project_python_path
from tardigrade_local.realnode import RealNode
from tardigrade_local.registry import Registry, RegistryError

log = logging.getLogger(__name__)

SPOT_LABEL = "cloud.google.com/gke-spot"
IMAGES = ("operator", "trainer-cpu")
IMAGE_VERSION = "0.1.0"
OPERATOR_RELEASE, OPERATOR_NAMESPACE = "tardigrade", "tardigrade-system"
CHECKPOINT_CLAIM = "shared-checkpoints"
CHECKPOINT_MOUNT = "/mnt/checkpoints"
# The GCS emulator's bucket (`ClusterConfig.buckets`' default).
GCS_BUCKET = "tardigrade"
# Pulls of the operator image on a node, on a machine other runs share.
INSTALL_TIMEOUT = "300s"
CLAIM_TIMEOUT_SECONDS = 60.0
# The files of a cluster run by `serve` (`tardigrade local up`), under its
# state directory.
CONFIG_FILE = "realcluster-config.json"
INFO_FILE = "realcluster.json"
LOG_FILE = "realcluster.log"
STOP_TIMEOUT_SECONDS = 300.0
# How long GKE's part goes on trying to delete a gone VM's Node object.
NODE_DELETE_TIMEOUT_SECONDS = 120.0
REGISTRY_ATTEMPTS = 3
# A maintenance under way when the cluster stops: the handler's drain (the pods' grace and
# a margin) and logind's shutdown delay.
MAINTENANCE_STOP_TIMEOUT_SECONDS = 180.0
T = TypeVar("T")


class RealClusterError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class NodePlan:
    """A node to start: `config` (labels, taints, pool, allocatable resources; None: the
    default pool, no taints, the whole machine allocatable), with `spot` adding GKE's spot
    label and `kubelet_feature_gates` over the config's."""

    name: str
    spot: bool = False
    # The kubelet's feature gates over its release's defaults (`RealNode`'s `feature_gates`).
    kubelet_feature_gates: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    config: NodeConfig | None = None

    @classmethod
    def of(cls, config: NodeConfig) -> NodePlan:
        return cls(config.name, spot=config.labels.get(SPOT_LABEL) == "true", config=config)

    def node_config(self) -> NodeConfig:
        """The node as `RealNode` makes it (`nodeshape.py`); an empty capacity leaves the
        kubelet's figures (the machine's) alone."""
        base = self.config if self.config is not None else NodeConfig(self.name, capacity={})
        labels = {**base.labels, **({SPOT_LABEL: "true"} if self.spot else {})}
        return dataclasses.replace(base, name=self.name, labels=labels,
                                   feature_gates={**base.feature_gates,
                                                  **self.kubelet_feature_gates})


def plan_nodes(nodes: int, spot_nodes: int) -> list[NodePlan]:
    """`real-1`... in order: the ordinary nodes first (the chart keeps the operator off spot
    nodes), then the spot ones."""
    return [NodePlan(f"real-{i}", spot=i > nodes) for i in range(1, nodes + spot_nodes + 1)]


def _simulable(config: NodeConfig) -> NodeConfig:
    """`config` with the figures its kubelet reports from the machine where it leaves them
    (an empty capacity), for the autoscaler's simulation of nodes on their way."""
    machine = nodeshape.Machine.here().capacity()
    return dataclasses.replace(config, capacity={
        **machine, "pods": DEFAULT_NODE_CAPACITY["pods"], **config.capacity})


def helm_binary() -> str:
    found = shutil.which("helm") or str(repo_root() / ".ci" / "cache" / "helm")
    if not Path(found).exists():
        raise RealClusterError("no helm binary on PATH: run .ci/install-kube-clients.sh "
                               ".ci/cache (or install helm 3)")
    return found


class RealNodeCluster:
    """```
    with RealNodeCluster(tmp / "real", plan_nodes(1, 2)) as real:
        real.install_operator("--set", "operator.restartInPlace=true")
        ...  # real.kubeconfig, real.images["trainer-cpu"], claim CHECKPOINT_CLAIM
    ```
    Every directory lives under `directory`; a node's must stay within
    `realnode.MAX_DIRECTORY_CHARS` (unix socket paths), so keep `directory` short."""

    def __init__(self, directory: Path, nodes: Sequence[NodePlan | NodeConfig],
                 checkpoint_namespace: str = "default", gcs: bool = True, kueue: bool = False,
                 kueue_wait_for_pods_ready: WaitForPodsReady | None = None,
                 node_lease_seconds: int = realnode.NODE_LEASE_SECONDS,
                 node_monitor_grace_seconds: float = NODE_MONITOR_GRACE_SECONDS,
                 node_monitor_period_seconds: float = NODE_MONITOR_PERIOD_SECONDS,
                 pools: Sequence[NodePool] = (),
                 autoscaler_scan_seconds: float = SCAN_INTERVAL_SECONDS,
                 pods_api_through_proxy: bool = False) -> None:
        """`nodes`: the nodes to start (a `NodeConfig` is `NodePlan.of` it).
        `pools`: node pools the cluster autoscaler grows (`gke/autoscaler.py`, scanning every
        `autoscaler_scan_seconds`): a scale-up starts a real node of the pool's template,
        named as the autoscaler names it, `provision_seconds` after. A pool with
        `queued_provisioning` grows only for ProvisioningRequests (`gke/provisioning.py`,
        with `kueue` only): all of a request's nodes start together from its template, and
        each is deleted (its VM and its Node) once the request is gone and the node empty.
        `gcs`: run the GCS emulator (bucket `GCS_BUCKET`) and its Service for pods.
        `kueue`: run Kueue's manager (`LocalCluster(kueue=True)`), with
        `kueue_wait_for_pods_ready` (None: Kueue's default).
        `node_lease_seconds`: the kubelets' nodeLeaseDurationSeconds (renewed every quarter
        of it); `node_monitor_grace_seconds` and `node_monitor_period_seconds`:
        kube-controller-manager's --node-monitor-grace-period and --node-monitor-period (a
        node whose Lease went unrenewed that long turns Unknown); the grace must exceed the
        renew interval.
        `pods_api_through_proxy`: pods reach kube-apiserver (the `kubernetes` Service) through
        the control plane's API proxy, whose `cut_watches` then cuts the chart's operator's
        watches too (`ClusterAPI`'s `through_proxy`)."""
        nodes = [n if isinstance(n, NodePlan) else NodePlan.of(n) for n in nodes]
        names = [n.name for n in nodes]
        if not names:
            raise ValueError("a real-node cluster needs at least one node")
        if len(set(names)) != len(names):
            raise ValueError(f"node names repeat: {names}")
        self.directory = directory.absolute()
        self.plan = list(nodes)
        self.pools = list(pools)
        self.autoscaler_scan_seconds = autoscaler_scan_seconds
        # Reclaimed VMs their pool is recreating, by name (what the autoscaler counts as on
        # their way).
        self.recreating: dict[str, NodeConfig] = {}
        # The autoscaler's thread, its loop and its GKE client, while it runs.
        self._autoscaler: tuple[threading.Thread, asyncio.AbstractEventLoop,
                                asyncio.Event] | None = None
        self._pool_cloud: GkeCloud | None = None
        self.checkpoint_namespace = checkpoint_namespace
        self.cluster = LocalCluster(self.directory / "control", nodes=[], with_gcs=gcs,
                                    buckets=[GCS_BUCKET],
                                    node_egress=True, endpoint_controllers=True,
                                    load_repo_crds=False, kueue=kueue,
                                    kueue_wait_for_pods_ready=kueue_wait_for_pods_ready,
                                    node_monitor_grace_seconds=node_monitor_grace_seconds,
                                    node_monitor_period_seconds=node_monitor_period_seconds)
        self.node_lease_seconds = node_lease_seconds
        self.pods_api_through_proxy = pods_api_through_proxy
        self.registry = Registry(self.directory / "registry" / "storage",
                                 log_path=self.directory / "registry" / "registry.log")
        self.network = ClusterNetwork(self.directory / "net")
        self.images: dict[str, str] = {}
        self.dns: ClusterDNS | None = None
        self.api: ClusterAPI | None = None
        self.gcs: ClusterGCS | None = None
        self.nodes: dict[str, RealNode] = {}
        # Nodes whose VM is gone (reclaimed or halted); their directories keep their pods'
        # logs.
        self.retired: list[RealNode] = []
        # Each VM being recreated: its thread, and an event set once it started (or failed).
        self._recreations: list[tuple[threading.Thread, threading.Event]] = []
        self._lock = threading.Lock()
        self._stopping = False
        # Scheduled host maintenances (`schedule_maintenance`), each a thread.
        self._maintenances: list[threading.Thread] = []
        # Set once the cluster stops: the threads that recreated nodes stop them and end.
        self._stopped = threading.Event()
        self.checkpoints = self.directory / "checkpoints"
        self.with_gcs = gcs
        self.with_kueue = kueue
        self._stack = contextlib.ExitStack()

    # --- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> RealNodeCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self, progress: Callable[[str], None] = log.info) -> RealNodeCluster:
        """Start everything; on a failure, stop what was started and raise."""
        # Whatever a killed run of ours left (its processes died with it; namespaces, mounts
        # and cgroups did not).
        realnode.sweep_orphans()
        nodenet.sweep_orphans()
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            self._start(progress)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, progress: Callable[[str], None]) -> None:
        stack = self._stack
        progress("control plane" + (" and Kueue" if self.with_kueue else ""))
        stack.enter_context(self.cluster)
        progress("image registry")
        self._start_registry()
        for name in IMAGES:
            progress(f"image {name} (built only when its inputs changed), pushed")
            self.images[name] = imagebuild.push(imagebuild.build(name), self.registry.host,
                                                IMAGE_VERSION)
        progress("cluster network, DNS, the kubernetes Service"
                 + (f" and the GCS emulator's ({clustergcs.HOST})" if self.with_gcs else ""))
        stack.enter_context(self.network)
        self.dns = stack.enter_context(ClusterDNS(self.network, self.cluster.info,
                                                  self.directory / "dns"))
        self.api = stack.enter_context(ClusterAPI(self.network, self.cluster.info,
                                                  self.directory / "api",
                                                  through_proxy=self.pods_api_through_proxy))
        if self.with_gcs:
            self.gcs = stack.enter_context(ClusterGCS(self.network, self.cluster.info,
                                                      self.directory / "gcs"))
        for plan in self.plan:
            progress(f"node {plan.name}")
            self._start_node(plan, self.directory / "nodes" / plan.name)
        with self.kube() as api:
            progress(f"checkpoint volume {CHECKPOINT_CLAIM} ({self.checkpoints})")
            self._offer_checkpoints(kubernetes.client.CoreV1Api(api))
        if self._autoscaled_pools() or self._queued_pools():
            progress(f"GKE's cluster autoscaler ({', '.join(p.name for p in self.pools)}"
                     + (", queued provisioning" if self._queued_pools() else "") + ")")
            self._start_autoscaler()

    def _start_node(self, plan: NodePlan, directory: Path) -> RealNode:
        """Start a node (a VM boots, its kubelet registers) as its pool makes it: labels,
        taints, allocatable resources (`plan.node_config()`, `nodeshape.py`)."""
        index = self.plan.index(plan) + 1
        node = RealNode.for_cluster(self.cluster.info, plan.name, directory, index=index,
                                    registry=self.registry.host, network=self.network,
                                    node_lease_seconds=self.node_lease_seconds,
                                    config=plan.node_config())
        with self._lock:
            if self._stopping:
                raise RealClusterError(f"node {plan.name}: the cluster is stopping")
            # Registered before it starts: a node that fails half-way is stopped too.
            self.nodes[plan.name] = node
            self._stack.callback(node.stop)
        node.start()
        return node

    # --- node pools, their autoscaler and queued provisioning (gke/autoscaler.py's
    # `NodePoolHost` and `ProvisioningHost`) --------------------------------------------------
    def _autoscaled_pools(self) -> list[NodePool]:
        return [p for p in self.pools if not p.queued_provisioning]

    def _queued_pools(self) -> list[NodePool]:
        """Pools GKE's queued provisioning grows: only where Kueue runs (the
        ProvisioningRequest CRD comes with it, `kueue.py`), as `cluster.py` has it."""
        return [p for p in self.pools if p.queued_provisioning] if self.with_kueue else []

    @property
    def cloud(self) -> GkeCloud:
        """The autoscaler's GKE client (`identities.CLOUD`), on the autoscaler's loop."""
        if self._pool_cloud is None:
            raise RealClusterError("no cluster autoscaler runs (RealNodeCluster(pools=...))")
        return self._pool_cloud

    def pool_sizes(self) -> Counter[str]:
        """Nodes running in each pool, less those going that are counted as on their way."""
        with self._lock:
            return Counter(self._plan_of(name).node_config().pool for name in self.nodes
                           if name not in self.recreating)

    def upcoming_nodes(self) -> list[NodeConfig]:
        with self._lock:
            return [_simulable(config) for config in self.recreating.values()]

    def has_node(self, name: str) -> bool:
        with self._lock:
            return any(p.name == name for p in self.plan)

    async def add_node(self, config: NodeConfig) -> None:
        """A new VM of `config`'s pool boots and its kubelet registers (the node pool's
        instance group grew); RealClusterError if it did not start."""
        plan = NodePlan.of(config)
        with self._lock:
            if self._stopping:
                raise RealClusterError(f"node {config.name}: the cluster is stopping")
            if any(p.name == config.name for p in self.plan):
                raise RealClusterError(f"node {config.name} already exists")
            self.plan.append(plan)
            settled = threading.Event()
            thread = threading.Thread(
                target=self._recreate, args=(plan, self.directory / "nodes" / plan.name, 0.0,
                                             settled),
                name=f"add-{plan.name}", daemon=True)
            self._recreations.append((thread, settled))
        thread.start()
        await asyncio.to_thread(settled.wait)
        if config.name not in self.nodes:
            raise RealClusterError(f"node {config.name} did not start (the log says why)")

    async def remove_node(self, name: str) -> None:
        """GKE gives a released ProvisioningRequest's empty node back: its VM is deleted
        (`RealNode.stop`: nothing runs on it any more; its directory keeps its logs,
        `retired`) and its Node object goes. The name stays taken."""
        with self._lock:
            node = self.nodes.get(name)
        if node is None:
            return
        await asyncio.to_thread(node.stop)
        with self._lock:
            if self.nodes.get(name) is node:
                self.retired.append(node)
                del self.nodes[name]
        await self.cloud.delete_node(name)

    def _plan_of(self, name: str) -> NodePlan:
        return next(p for p in self.plan if p.name == name)

    def _start_autoscaler(self) -> None:
        """The cluster autoscaler (for the pools it grows) and GKE's queued provisioning (for
        the queued-provisioning pools, with Kueue) on a loop of its own thread, with GKE's
        identity."""
        started = threading.Event()
        failed: list[BaseException] = []

        async def run() -> None:
            done = asyncio.Event()
            self._pool_cloud = GkeCloud(ApiClient(
                self.cluster.api_url, self.cluster.identity_ssl_context(identities.CLOUD),
                identities.CLOUD.common_name))
            parts: list[NodeAutoscaler | QueuedProvisioner] = []
            if self._autoscaled_pools():
                parts.append(NodeAutoscaler(self, self.pools, self.autoscaler_scan_seconds))
            if self._queued_pools():
                parts.append(QueuedProvisioner(self, self.pools))
            try:
                for part in parts:
                    await part.start()
                self._autoscaler = (threading.current_thread(), asyncio.get_running_loop(),
                                    done)
                started.set()
                await done.wait()
            finally:
                for part in parts:
                    await part.stop()
                await self._pool_cloud.close()

        def thread_main() -> None:
            try:
                asyncio.run(run())
            except BaseException as err:  # raised by _start_autoscaler, or logged
                failed.append(err)
                log.exception("the cluster autoscaler stopped")
            finally:
                started.set()

        thread = threading.Thread(target=thread_main, name="autoscaler", daemon=True)
        thread.start()
        started.wait()
        if failed:
            raise RealClusterError(f"the cluster autoscaler did not start: {failed[0]}")

    def _stop_autoscaler(self) -> None:
        running, self._autoscaler = self._autoscaler, None
        if running is not None:
            thread, loop, done = running
            loop.call_soon_threadsafe(done.set)
            # Its scale-ups under way finish starting their node first (`_recreate`).
            thread.join(realnode.START_TIMEOUT_SECONDS + 60)

    # --- GKE's part --------------------------------------------------------------------------
    def reclaim(self, name: str, replace_after_seconds: float | None = None
                ) -> dict[str, Any]:
        """A spot reclaim of node `name`, as GKE does it: the VM shuts down
        (`RealNode.shutdown`: logind's PrepareForShutdown, the real kubelet's graceful node
        shutdown), then it is gone and GKE's cloud node lifecycle controller deletes its Node
        object. A host of a multi-host TPU slice goes with every host of its slice pool, their
        VMs shut down at once (GKE shuts down every TPU VM of the slice: `gke/tpuslices.py`).
        With `replace_after_seconds`, the node pool's managed instance group recreates the
        VMs under the same names that long after (GKE documents no figure: the caller picks
        it; a slice's hosts all at once); a new VM has a fresh disk (a new node directory;
        the old one's pod logs stay, `retired`). Returns logind's account of `name`'s
        shutdown."""
        hosts = self._slice_of(name)
        with contextlib.ExitStack() as coming_back:
            for host in hosts:
                coming_back.enter_context(self._coming_back(host.name, replace_after_seconds))
            accounts = self._shut_down(hosts)
            gone = [host for host in hosts if isinstance(accounts[host.name], dict)]
            for host in gone:
                self._delete_node_object(host.name)
            for host in gone:
                self._retire(host, replace_after_seconds)
            failed = [error for error in accounts.values() if isinstance(error, BaseException)]
            if failed:
                raise failed[0]
        account = accounts[name]
        assert isinstance(account, dict)
        return account

    def _slice_of(self, name: str) -> list[RealNode]:
        """Node `name`, or every running host of its multi-host TPU slice pool."""
        with self._lock:
            running = {n: self._plan_of(n).node_config() for n in self.nodes}
            if name in running:
                hosts = tpuslices.slice_of(running[name], running.values())
                return [self.nodes[host.name] for host in hosts]
        raise RealClusterError(f"no running node {name!r} (running: {sorted(running)})")

    @staticmethod
    def _shut_down(hosts: Sequence[RealNode]) -> dict[str, dict[str, Any] | BaseException]:
        """Shut the VMs down at once (a thread each, as a maintenance's shutdown runs on a
        thread of its own); each one's account, or what went wrong."""
        results: dict[str, dict[str, Any] | BaseException] = {}
        with concurrent.futures.ThreadPoolExecutor(len(hosts)) as pool:
            futures = {host.name: pool.submit(host.shutdown) for host in hosts}
        for host, future in futures.items():
            error = future.exception()
            results[host] = error if error is not None else future.result()
        return results

    def halt(self, name: str, back_after_seconds: float | None = None) -> None:
        """Node `name`'s VM is lost without a shutdown (a host error, a power loss):
        `RealNode.halt`, everything on it killed at once, nobody told. The Node object stays:
        kube-controller-manager's node lifecycle controller turns it Unknown once its Lease
        goes unrenewed and taints it unreachable, and taint eviction deletes its pods at
        their tolerations' end (local_cluster/README.md, "Ungraceful node loss"). With
        `back_after_seconds`, the VM boots again under its name that long after, as
        `reclaim`'s recreation (a fresh disk: a new node directory), and its kubelet
        registers with the Node object that stayed.

        A host of a multi-host TPU slice takes its slice with it: Compute Engine recovers or
        reschedules every instance of a multi-host slice together, never one alone ("Failure
        recovery of TPU instances"), so the slice's other VMs stop as any stopped VM does,
        through a shutdown (logind, the kubelet's graceful node shutdown), their Node objects
        staying too, and all come back together."""
        hosts = self._slice_of(name)
        node = self._node(name)
        others = [host for host in hosts if host is not node]
        with contextlib.ExitStack() as coming_back:
            for host in hosts:
                coming_back.enter_context(self._coming_back(host.name, back_after_seconds))
            node.halt()
            self._retire(node, back_after_seconds)
            if not others:
                return
            accounts = self._shut_down(others)
            for host in others:
                if isinstance(accounts[host.name], dict):
                    self._retire(host, back_after_seconds)
            failed = [error for error in accounts.values() if isinstance(error, BaseException)]
            if failed:
                raise failed[0]

    def lose(self, name: str) -> None:
        """Node `name`'s VM is deleted for good without a shutdown: `halt`, then GKE's cloud
        node lifecycle controller deletes its Node object (the VM is gone), as after a
        reclaim; its pods are left to pod GC."""
        self.halt(name)
        self._delete_node_object(name)

    def _delete_node_object(self, name: str) -> None:
        """GKE's cloud node lifecycle controller deletes the Node of a VM that is gone, and
        tries again while the API server does not answer (restarting, a connection cut)."""
        deadline = time.monotonic() + NODE_DELETE_TIMEOUT_SECONDS
        while True:
            try:
                with self.kube() as api:
                    kubernetes.client.CoreV1Api(api).delete_node(name)
                return
            except kubernetes.client.ApiException as err:
                if err.status < 500:
                    return  # 404: gone already
                error: Exception = err
            except urllib3.exceptions.HTTPError as err:
                error = err
            if time.monotonic() > deadline:
                raise RealClusterError(f"the Node {name} was not deleted within "
                                       f"{NODE_DELETE_TIMEOUT_SECONDS:.0f} s: {error}")
            time.sleep(0.5)

    def schedule_maintenance(self, name: str, in_seconds: float,
                             back_after_seconds: float | None = DEFAULT_REPLACE_AFTER_SECONDS
                             ) -> float:
        """GKE's scheduled host maintenance of node `name` (a GPU/TPU VM, which cannot
        live-migrate; sources in local_cluster/README.md, "Scheduled host maintenance"),
        GKE's part in `gke/hostmaintenance.py` (GKE's identity): labelled now with the start,
        `in_seconds` from now (epoch seconds, returned); at the start tainted
        impending-node-termination:NoSchedule and its pods deleted with their own grace (at
        most 1 h) by GKE's maintenance handler, then the VM shuts down as for `reclaim`
        (logind, the kubelet's graceful node shutdown) and its Node object goes; it comes
        back under its name `back_after_seconds` later (None: never), a fresh VM without the
        label. A host of a multi-host TPU slice: every host of the slice, at the same start
        (maintenance of one instance of a slice puts all of them into maintenance, and the
        slice is rescheduled as one: "Manually start a host maintenance event")."""
        hosts = self._slice_of(name)
        start = self._as_cloud(lambda cloud: hostmaintenance.announce(cloud, name, in_seconds))
        for host in hosts:
            if host.name != name:
                self._as_cloud(lambda cloud, host=host: hostmaintenance.announce_at(
                    cloud, host.name, start))
        for host in hosts:
            thread = threading.Thread(target=self._maintain,
                                      args=(host, start, back_after_seconds),
                                      name=f"maintenance-{host.name}", daemon=True)
            with self._lock:
                self._maintenances.append(thread)
            thread.start()
        return start

    def _maintain(self, node: RealNode, start: float, back_after_seconds: float | None
                  ) -> None:
        """At `start`, unless the cluster stops or the VM went first: GKE's maintenance
        (`realreclaim.maintain`), then the VM's return."""
        while time.time() < start:
            if self._stopping:
                return
            time.sleep(min(0.5, max(0.0, start - time.time())))
        with self._lock:
            if self._stopping or self.nodes.get(node.name) is not node:
                return  # the VM went away meanwhile: nothing left to maintain
        try:
            deleted = self._as_cloud(lambda cloud: realreclaim.maintain(cloud, node, start))
        except Exception:  # logged: the caller waits for the Node, and says what it saw
            log.exception("the host maintenance of node %s failed", node.name)
            return
        log.info("host maintenance of node %s: the handler deleted %s, the VM shut down",
                 node.name, deleted or "no pod")
        self._retire(node, back_after_seconds)

    def _as_cloud(self, act: Callable[[GkeCloud], Awaitable[T]]) -> T:
        """Run `act` with GKE's own client (`identities.CLOUD`), on a loop of its own."""
        async def run() -> T:
            cloud = GkeCloud(ApiClient(self.cluster.api_url,
                                       self.cluster.identity_ssl_context(identities.CLOUD),
                                       identities.CLOUD.common_name))
            try:
                return await act(cloud)
            finally:
                await cloud.close()

        return asyncio.run(run())

    def partition(self, name: str) -> None:
        """Node `name` and the control plane cannot reach each other while its pods run on
        (`RealNode.partition`) until `heal`."""
        self._node(name).partition()

    def heal(self, name: str) -> None:
        self._node(name).heal()

    def _node(self, name: str) -> RealNode:
        with self._lock:
            node = self.nodes.get(name)
        if node is None:
            raise RealClusterError(f"no running node {name!r} (running: {sorted(self.nodes)})")
        return node

    @contextlib.contextmanager
    def _coming_back(self, name: str, back_after_seconds: float | None) -> Iterator[None]:
        """While node `name`'s VM goes, one its pool will recreate is already on its way
        (`recreating`, which the autoscaler counts as upcoming), as the instance group
        recreates it from the moment it was lost: pods its shutdown fails are not a reason
        to grow another pool meanwhile."""
        if back_after_seconds is None:
            yield
            return
        with self._lock:
            self.recreating[name] = self._plan_of(name).node_config()
        try:
            yield
        except BaseException:
            with self._lock:
                if name in self.nodes:  # not gone: a retired one is recreated (`_retire`)
                    self.recreating.pop(name, None)
            raise

    def _retire(self, node: RealNode, back_after_seconds: float | None) -> None:
        """The VM of `node` is gone (its directory kept, `retired`); with
        `back_after_seconds` one boots under its name that long after, with a fresh disk."""
        with self._lock:
            self.retired.append(node)
            del self.nodes[node.name]
            if back_after_seconds is not None and not self._stopping:
                plan = self._plan_of(node.name)
                self.recreating[node.name] = plan.node_config()
                generation = sum(1 for n in self.retired if n.name == node.name)
                directory = self.directory / "nodes" / f"{node.name}.{generation}"
                settled = threading.Event()
                thread = threading.Thread(target=self._recreate,
                                          args=(plan, directory, back_after_seconds, settled),
                                          name=f"recreate-{node.name}", daemon=True)
                self._recreations.append((thread, settled))
                thread.start()

    def _recreate(self, plan: NodePlan, directory: Path, delay: float,
                  settled: threading.Event) -> None:
        """Start the VM `delay` seconds from now, then live until the cluster has stopped it:
        the node's processes die with the thread that started them (PR_SET_PDEATHSIG is
        the parent thread's, not its process's; `lifetime.die_with_parent`), so this thread
        must outlive them or the new VM would die, all at once, as soon as it started."""
        try:
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline:
                if self._stopping:
                    return
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            try:
                self._start_node(plan, directory)
            except Exception:  # logged: the caller waits for the Node, and says what it saw
                log.exception("node %s was not started", plan.name)
                return
        finally:
            with self._lock:
                self.recreating.pop(plan.name, None)
            settled.set()
        self._stopped.wait()

    def _settle_recreations(self) -> list[threading.Thread]:
        """No more recreations; those under way finish starting (to be stopped in order)."""
        with self._lock:
            self._stopping = True
            recreations = list(self._recreations)
        for _, settled in recreations:
            settled.wait(realnode.START_TIMEOUT_SECONDS + 60)
        return [thread for thread, _ in recreations]

    def all_nodes(self) -> list[RealNode]:
        """Every node this cluster started, the running and the retired: where every pod's
        logs are."""
        with self._lock:
            return [*self.retired, *self.nodes.values()]

    def pod_logs_dirs(self) -> list[Path]:
        """Every node's pod log folder (the kubelet's podLogsDir), the retired nodes' too: what
        a logging agent on each node reads (logshipper.py)."""
        return [node.pod_logs_dir for node in self.all_nodes()]

    def _start_registry(self) -> None:
        """Its port is picked free, then bound by the registry a moment later: another
        server of the machine may take it meanwhile, so a registry that exits at once gets
        another port."""
        for attempt in range(1, REGISTRY_ATTEMPTS + 1):
            try:
                self._stack.enter_context(self.registry)
                return
            except RegistryError as err:
                tail = ""
                if self.registry.log_path is not None:
                    with contextlib.suppress(OSError):
                        tail = self.registry.log_path.read_text(errors="replace")[-2000:]
                if attempt == REGISTRY_ATTEMPTS:
                    raise RealClusterError(f"{err}:\n{tail}") from err
                log.warning("the registry did not start (%s), another port: %s", err, tail)
                self.registry = Registry(self.registry.storage, log_path=self.registry.log_path)

    def _offer_checkpoints(self, core: kubernetes.client.CoreV1Api) -> None:
        """One host directory every node mounts (the nodes share the host's filesystem),
        offered by the admin as a ReadWriteMany PersistentVolume bound to a claim of the
        jobs' namespace: a shared filesystem (Filestore over NFS on GKE)."""
        self.checkpoints.mkdir(exist_ok=True)
        self.checkpoints.chmod(0o1777)  # the trainer runs as its image's non-root user
        namespace = self.checkpoint_namespace
        if namespace != "default":
            with contextlib.suppress(kubernetes.client.ApiException):
                core.create_namespace({"metadata": {"name": namespace}})
        core.create_persistent_volume({
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": CHECKPOINT_CLAIM},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                     "hostPath": {"path": str(self.checkpoints), "type": "Directory"},
                     "claimRef": {"namespace": namespace, "name": CHECKPOINT_CLAIM}}})
        core.create_namespaced_persistent_volume_claim(namespace, {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": CHECKPOINT_CLAIM},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "",
                     "volumeName": CHECKPOINT_CLAIM,
                     "resources": {"requests": {"storage": "1Gi"}}}})
        deadline = time.monotonic() + CLAIM_TIMEOUT_SECONDS
        while core.read_namespaced_persistent_volume_claim(
                CHECKPOINT_CLAIM, namespace).status.phase != "Bound":
            if time.monotonic() > deadline:
                raise RealClusterError(f"the claim {namespace}/{CHECKPOINT_CLAIM} was not "
                                       f"bound within {CLAIM_TIMEOUT_SECONDS:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop everything started, in the reverse order (a node being recreated first
        finishes starting), then remove the registry's storage (the images pushed, hundreds
        of MB; a new cluster pushes them again). Idempotent."""
        with self._lock:
            self._stopping = True  # no scale-up starts a node from now on
        self._stop_autoscaler()
        threads = self._settle_recreations()  # and no more of anything
        with self._lock:
            maintenances = list(self._maintenances)
        for thread in maintenances:
            # One waiting for its start ends at once; one under way finishes (its drain is
            # bounded by the pods' grace, its shutdown by logind's delay).
            thread.join(MAINTENANCE_STOP_TIMEOUT_SECONDS)
        self._stack.close()
        self._stopped.set()
        for thread in threads:
            thread.join(10)
        shutil.rmtree(self.registry.storage, ignore_errors=True)

    def leftovers(self) -> dict[str, list[str]]:
        """What of the nodes and the network is still on the machine (all empty once
        stopped), keyed `<node or network>: <kind>`."""
        found: dict[str, list[str]] = {}
        for node in self.all_nodes():
            for kind, items in node.leftovers().items():
                if items:
                    found.setdefault(f"{node.name}: {kind}", []).extend(items)
        for kind, items in self.network.leftovers().items():
            found[f"network: {kind}"] = items
        return found

    # --- using it ----------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.cluster.kubeconfig

    @property
    def gcs_url(self) -> str:
        """The GCS emulator's URL on the host (its loopback)."""
        url = self.cluster.gcs_url
        if not url:
            raise RealClusterError("this cluster runs no GCS emulator (gcs=False)")
        return url

    def gcs_pod_env(self) -> dict[str, str]:
        """The GCS emulator's client environment for pods of the real nodes (a TrainingJob's
        `spec.env`: a real kubelet adds nothing to a pod's environment)."""
        if self.gcs is None:
            raise RealClusterError("this cluster runs no GCS emulator (gcs=False)")
        return clustergcs.pod_env()

    def kube(self) -> kubernetes.client.ApiClient:
        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))

    def helm(self, *args: str, timeout: float = 600) -> str:
        done = subprocess.run([helm_binary(), *args],
                              env={**os.environ, **self.cluster.client_env()},
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RealClusterError(f"helm {' '.join(args[:2])} failed:\n"
                                   f"{done.stdout}{done.stderr}")
        return done.stdout

    def operator_image_values(self) -> tuple[str, ...]:
        """The helm arguments that point a chart at the registry's operator image."""
        repository, tag = self.images["operator"].rsplit(":", 1)
        return ("--set", f"image.repository={repository}", "--set", f"image.tag={tag}")

    def install_operator(self, *values: str) -> str:
        """`helm install` of the chart with the registry's operator image, one replica, no
        leader election; `values`: more helm arguments (`--set`, ...)."""
        return self.helm("install", OPERATOR_RELEASE, str(repo_root() / "charts" / "tardigrade"),
                         "-n", OPERATOR_NAMESPACE, "--create-namespace",
                         *self.operator_image_values(),
                         "--set", "replicaCount=1", "--set", "leaderElection.enabled=false",
                         *values, "--wait", "--timeout", INSTALL_TIMEOUT)

    def uninstall_operator(self) -> str:
        """`helm uninstall` of `install_operator`'s release, waiting until its objects are
        gone (the chart's pre-delete hook runs first); the kept CRD and the jobs stay."""
        return self.helm("uninstall", OPERATOR_RELEASE, "-n", OPERATOR_NAMESPACE,
                         "--wait", "--timeout", INSTALL_TIMEOUT)

    def describe(self) -> dict[str, Any]:
        """What was started, for `tardigrade local status` and `down`."""
        return {"kubeconfig": str(self.kubeconfig), "api_url": self.cluster.api_url,
                "control_dir": str(self.cluster.layout.root),
                "registry": self.registry.host, "images": dict(self.images),
                "checkpoints": str(self.checkpoints), "checkpoint_claim": CHECKPOINT_CLAIM,
                "checkpoint_namespace": self.checkpoint_namespace,
                "kueue": self.with_kueue,
                **({"gcs_url": self.gcs_url, "gcs_bucket": GCS_BUCKET,
                    "gcs_pod_url": clustergcs.pod_url(), "gcs_pod_env": self.gcs_pod_env()}
                   if self.gcs is not None else {}),
                "nodes": [{"name": n.name, "spot": n.spot,
                           "ip": self.nodes[n.name].addresses.node_ip,
                           "directory": str(self.nodes[n.name].directory)}
                          for n in self.plan if n.name in self.nodes],
                "network": self.network.id}


# --- run by `tardigrade local up` ------------------------------------------------------------
DEFAULT_SLICE_SHAPE = "tpu-v5-lite-podslice:2x4:4"
# A slice host's allocatable: one trainer a host, several hosts on a 2-core machine (a real
# node's figures must fit the machine, `nodeshape.py`). Its chips come from the shape.
SLICE_HOST_CAPACITY = {"cpu": "1", "memory": "4Gi", "pods": "20"}


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    nodes: int = 1
    spot_nodes: int = 0
    operator: bool = True
    # The GCS emulator, and its Service for pods.
    gcs: bool = True
    # More `helm install` arguments for the operator.
    helm_values: tuple[str, ...] = ()
    # Kueue's manager, and its waitForPodsReady timeout in seconds (0: Kueue's default).
    kueue: bool = False
    kueue_pods_ready_timeout: float = 0.0
    # Spot multi-host TPU slice pools tpu-slice-1..., each a slice of this shape
    # (`SliceShape.parse`), a real node a host.
    tpu_slices: int = 0
    tpu_slice_shape: str = DEFAULT_SLICE_SHAPE

    def plan(self) -> list[NodePlan]:
        """The nodes to start: `plan_nodes`' ordinary and spot ones, then the slices' hosts
        (named `tpu-slice-<i>-<host>`). ValueError naming the shape if it is not one."""
        shape = tpuslices.SliceShape.parse(self.tpu_slice_shape)
        hosts = [NodePlan.of(config) for i in range(1, self.tpu_slices + 1)
                 for config in tpuslices.slice_nodes(f"tpu-slice-{i}", shape,
                                                     host_capacity=SLICE_HOST_CAPACITY)]
        return [*plan_nodes(self.nodes, self.spot_nodes), *hosts]

    def wait_for_pods_ready(self) -> WaitForPodsReady | None:
        return (WaitForPodsReady(self.kueue_pods_ready_timeout)
                if self.kueue_pods_ready_timeout else None)


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def read_info(state_dir: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((state_dir / INFO_FILE).read_text()))
    except (OSError, ValueError):
        return None


def serve(state_dir: Path) -> int:
    """Start the cluster described by `state_dir`'s CONFIG_FILE, write INFO_FILE (`state`:
    starting, then running or failed), run until SIGTERM or SIGINT, then stop it all."""
    config = ServeConfig(**json.loads((state_dir / CONFIG_FILE).read_text()))
    stopping, running = threading.Event(), threading.Event()

    def on_signal(*_: object) -> None:
        if stopping.is_set():
            return  # the first one is being acted on
        stopping.set()
        if not running.is_set():
            # A `down` while it starts: what was started is stopped on the way out.
            raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    me = psutil.Process()
    base = {"pid": me.pid, "started": me.create_time()}
    write_json(state_dir / INFO_FILE, {**base, "state": "starting"})
    real = RealNodeCluster(state_dir, config.plan(),
                           gcs=config.gcs, kueue=config.kueue,
                           kueue_wait_for_pods_ready=config.wait_for_pods_ready())
    try:
        real.start()
        if config.operator:
            log.info("operator: helm install")
            real.install_operator(*config.helm_values)
    except BaseException as err:
        log.exception("the real-node cluster did not start")
        running.set()  # a signal now must not cut the teardown short
        real.stop()
        write_json(state_dir / INFO_FILE, {**base, "state": "failed", "error": str(err)})
        return 1
    running.set()
    # Where `tardigrade local up` without real nodes has it.
    (state_dir / "kubeconfig").symlink_to(real.kubeconfig.relative_to(state_dir))
    write_json(state_dir / INFO_FILE, {**base, "state": "running", "operator": config.operator,
                                       **real.describe(),
                                       "kubeconfig": str(state_dir / "kubeconfig")})
    log.info("real-node cluster running")
    stopping.wait()
    log.info("stopping")
    real.stop()
    left = {k: v for k, v in real.leftovers().items() if v}
    if left:
        log.error("left behind: %s", left)
    (state_dir / INFO_FILE).unlink(missing_ok=True)
    return 0


def _served_process(info: dict[str, Any] | None) -> psutil.Process | None:
    """The `serve` process `info` names, if it still runs (the same process, not a later one
    that got its pid)."""
    if not info:
        return None
    with contextlib.suppress(psutil.Error, KeyError, ValueError):
        proc = psutil.Process(int(info["pid"]))
        if proc.create_time() == info["started"]:
            return proc
    return None


def served_pid(state_dir: Path) -> int | None:
    """The pid of the `serve` process running the cluster in `state_dir`, if one runs."""
    proc = _served_process(read_info(state_dir))
    return proc.pid if proc is not None else None


def is_served(state_dir: Path) -> bool:
    """Whether `state_dir` holds a real-node cluster of `tardigrade local up`."""
    return (state_dir / CONFIG_FILE).exists()


def clear_state(state_dir: Path) -> None:
    """Tear down what a killed `serve` left (namespaces, mounts, cgroups of its nodes and
    network; its processes died with it), then remove the state directory. Only once
    nothing is mounted under it is it safe to remove: a pod's volume mount is the host's
    directory."""
    realnode.sweep_orphans()
    nodenet.sweep_orphans()
    if state_dir.exists():
        shutil.rmtree(state_dir)


def start_served(state_dir: Path, config: ServeConfig, timeout: float,
                 progress: TextIO | None = None) -> dict[str, Any]:
    """Run `serve` in a process of its own (it outlives this one) and return its INFO_FILE
    once the cluster runs; RealClusterError (with its log's end) if it does not start.
    `progress`: where its log goes meanwhile."""
    if (pid := served_pid(state_dir)) is not None:
        raise RealClusterError(f"a real-node cluster is already running in {state_dir} (pid "
                               f"{pid}); run `tardigrade local down` first")
    running = LocalCluster(state_dir).read_info()
    if running and psutil.pid_exists(int(running["pid"])):
        raise RealClusterError(f"a local cluster is already running in {state_dir} (pid "
                               f"{running['pid']}); run `tardigrade local down` first")
    clear_state(state_dir)
    state_dir.mkdir(parents=True)
    write_json(state_dir / CONFIG_FILE, dataclasses.asdict(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*project_python_path(),
                                                        os.environ.get("PYTHONPATH", "")])}
    log_path = state_dir / LOG_FILE
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "tardigrade_local.realcluster",
                                 str(state_dir)], stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    shown = 0
    while True:
        if progress is not None:
            text = log_path.read_text(errors="replace")
            progress.write(text[shown:])
            progress.flush()
            shown = len(text)
        info = read_info(state_dir) or {}
        if info.get("state") == "running":
            return info
        if info.get("state") == "failed" or proc.poll() is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(STOP_TIMEOUT_SECONDS)
            raise RealClusterError(f"the real-node cluster did not start: "
                                   f"{info.get('error', '')}\n"
                                   f"{log_path.read_text(errors='replace')[-3000:]}")
        if time.monotonic() > deadline:
            stop_served(state_dir)
            raise RealClusterError(f"the real-node cluster did not start within {timeout:.0f} "
                                   f"s; its log was {log_path}")
        time.sleep(0.5)


def stop_served(state_dir: Path, timeout: float = STOP_TIMEOUT_SECONDS) -> None:
    """Stop the `serve` process (SIGTERM: it takes the cluster down in order; SIGKILL after
    `timeout`, its processes dying with it), tear down whatever is left, remove the state
    directory."""
    proc = _served_process(read_info(state_dir))
    if proc is not None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except psutil.TimeoutExpired:
            with contextlib.suppress(psutil.Error):
                proc.kill()
                proc.wait(30)
    # The control plane and every process of the nodes died with it (PR_SET_PDEATHSIG).
    clear_state(state_dir)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(serve(Path(args[0]).absolute()))


if __name__ == "__main__":
    main()
