"""One pod on one simulated node: start its simulated containers, restart them per policy,
report, stop them.

All status the kubelet writes for a pod goes through `PodWorker.push`, which re-reads the pod
so that conditions other components added (e.g. DisruptionTarget from an eviction) survive.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tardigrade_local.gke import disruptions as d
from tardigrade_local.gke.client import ApiClient, ApiError, core_path
from tardigrade_local.gke.events import EventRecorder
from tardigrade_local.simulator import admission
from tardigrade_local.simulator import podstatus as ps
from tardigrade_local.simulator.config import SimulatorSettings
from tardigrade_local.simulator.env import EnvError
from tardigrade_local.simulator.launch import container_env_of, env_sources, termination_message
from tardigrade_local.simulator.restartrules import ALL_CONTAINERS_RESTARTING, KubeletGates, OnExit
from tardigrade_local.simulator.restartrules import on_exit as restart_on_exit
from tardigrade_local.simulator.simulated import SimulatedContainer, SimulatedRuntime
from tardigrade_local.simulator.volumes import (
    MOUNT_RETRY_FIRST_SECONDS,
    MOUNT_RETRY_MAX_SECONDS,
    NodeDisk,
    VolumeSetupError,
    set_up,
    tear_down,
)

log = logging.getLogger(__name__)

DEFAULT_GRACE_SECONDS = 30
# Status writes that fail are tried again, 0.05 s later and doubling up to 10 s (the status
# manager's sync period), for at most a minute.
STATUS_RETRY_FIRST_SECONDS = 0.05
STATUS_RETRY_MAX_SECONDS = 10.0
STATUS_RETRY_SECONDS = 60.0
SYNC_ERROR_BACK_OFF_SECONDS = 10.0


class Stop(enum.Enum):
    DELETED = "deleted"  # deletionTimestamp set: graceful, then finalize the object
    REMOVED = "removed"  # the object is already gone: just kill
    NODE_SHUTDOWN = "node-shutdown"  # spot reclaim: DisruptionTarget, grace, Failed
    NODE_LOST = "node-lost"  # the machine vanished: SIGKILL, no more reports
    DEADLINE = "deadline"  # activeDeadlineSeconds passed: kill, Failed/DeadlineExceeded


class PodWorker:
    def __init__(self, settings: SimulatorSettings, client: ApiClient, node_name: str,
                 host_ip: str, pod_ip: str, pod: Mapping[str, Any],
                 runtime: SimulatedRuntime,
                 events: EventRecorder | None = None,
                 gates: KubeletGates | None = None) -> None:
        self.settings = settings
        self.runtime = runtime
        self.gates = gates or KubeletGates()
        self.client = client
        self.events = events or EventRecorder(client)
        self.node_name = node_name
        self.host_ip = host_ip
        self.pod_ip = pod_ip
        self.pod = pod
        meta, spec = pod["metadata"], pod["spec"]
        self.namespace: str = meta.get("namespace") or "default"
        self.name: str = meta["name"]
        self.uid: str = meta.get("uid", "")
        self.restart_policy: str = spec.get("restartPolicy") or "Always"
        self.init_specs: list[Mapping[str, Any]] = list(spec.get("initContainers") or [])
        self.specs: list[Mapping[str, Any]] = list(spec.get("containers") or [])
        self.init_records = [ps.ContainerRecord(c["name"], c.get("image", ""))
                             for c in self.init_specs]
        self.records = [ps.ContainerRecord(c["name"], c.get("image", "")) for c in self.specs]
        if self.init_specs:
            for record in self.records:
                record.wait("PodInitializing")
        self.initialized = not self.init_specs
        self.processes: dict[str, SimulatedContainer] = {}
        self.disk = NodeDisk(settings.layout.node_root(node_name))
        self.volumes: dict[str, Path] = {}
        self.start_time = ps.now_rfc3339()
        self.terminal_phase: str | None = None
        self.terminated = False  # termination complete: no container runs, nothing is held
        self.reason: str | None = None
        self.message: str | None = None
        self.own_conditions: list[dict[str, Any]] = []
        self.stopping: Stop | None = None
        self.silent = False  # no more API writes (node lost, object gone)
        self._stop_requested = asyncio.Event()
        # Set when a RestartAllContainers rule fired: the message of its condition.
        self._restart_all: str | None = None
        self._restart_all_requested = asyncio.Event()
        self._grace: float = DEFAULT_GRACE_SECONDS
        self._push_lock = asyncio.Lock()
        self.task: asyncio.Task[None] | None = None
        self.done = asyncio.Event()

    # --- control -------------------------------------------------------------------------
    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"pod {self.namespace}/{self.name}")

    def update(self, pod: Mapping[str, Any]) -> None:
        self.pod = pod
        meta = pod["metadata"]
        if self.stopping is Stop.DELETED and meta.get("deletionGracePeriodSeconds") == 0:
            # A forced delete cuts the grace period short.
            for proc in list(self.processes.values()):
                proc.signal_group(signal.SIGKILL)
        if meta.get("deletionTimestamp") and self.stopping is None:
            grace = meta.get("deletionGracePeriodSeconds")
            if grace is None:
                grace = pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
            self.request_stop(Stop.DELETED, float(grace))

    def request_stop(self, kind: Stop, grace_seconds: float) -> None:
        if kind in (Stop.NODE_LOST, Stop.REMOVED):
            self.silent = True
        if kind is Stop.NODE_LOST:
            # The machine is gone: nothing gets a chance to clean up.
            for proc in list(self.processes.values()):
                proc.signal_group(signal.SIGKILL)
        # A graceful stop already under way keeps its grace; node loss overrides anything.
        if self.stopping is None or kind is Stop.NODE_LOST:
            self.stopping = kind
            self._grace = grace_seconds
        self._stop_requested.set()

    def _deadline_passed(self) -> None:
        if self.stopping is None and self.terminal_phase is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
            self.request_stop(Stop.DEADLINE, float(grace))

    def crash(self, container: str | None, sig: int) -> bool:
        """Deliver a signal as if the process died on its own (no stop request)."""
        names = [container] if container else list(self.processes)
        hit = False
        for name in names:
            proc = self.processes.get(name)
            if proc is not None:
                proc.signal_group(sig)
                hit = True
        return hit

    # --- lifecycle -----------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._run_pod()
        except Exception:
            log.exception("pod %s/%s: worker failed", self.namespace, self.name)
        finally:
            tear_down(self.disk, self.uid or self.name)
            self.done.set()

    async def _run_pod(self) -> None:
        layout = self.settings.layout
        layout.pod_dir(self.namespace, self.name).mkdir(parents=True, exist_ok=True)
        await self.push()
        stop_wait = asyncio.create_task(self._stop_requested.wait())
        main = asyncio.create_task(self._run_containers())
        deadline = self.pod["spec"].get("activeDeadlineSeconds")
        if deadline is not None:
            asyncio.get_running_loop().call_later(float(deadline), self._deadline_passed)
        await asyncio.wait({stop_wait, main}, return_when=asyncio.FIRST_COMPLETED)
        if self.stopping is not None:
            await self._stop(main)
        else:
            stop_wait.cancel()
            await main
            # Terminal: nothing restarts, and the volume manager tears the pod's volumes
            # down. The pod object stays until someone deletes it.
            tear_down(self.disk, self.uid or self.name)
            # The pod worker's termination is complete (`IsPodKnownTerminated`): a delete
            # that comes later does not make it hold resources again.
            self.terminated = True
            await self._stop_requested.wait()
            await self._stop(main)

    async def _mount_volumes(self) -> bool:
        """Set up the pod's volumes, retrying as the volume manager does; False if the pod
        was stopped first. The API-backed ones (projected, configMap, secret, downwardAPI)
        are empty directories: like kwok's, this kubelet fills no volume, and its shared
        identity is granted no tokens, ConfigMaps or Secrets."""
        delay = MOUNT_RETRY_FIRST_SECONDS
        volumes_dir = self.settings.layout.pod_dir(self.namespace, self.name) / "volumes"
        while self.stopping is None:
            try:
                self.volumes = set_up(self.pod, self.disk, lambda name: volumes_dir / name)
                return True
            except VolumeSetupError as err:
                self._event("FailedMount", str(err), warning=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_requested.wait(), delay)
            delay = min(delay * 2, MOUNT_RETRY_MAX_SECONDS)
        return False

    async def _run_containers(self) -> None:
        if not await self._mount_volumes():
            return
        restarts = 0
        while True:
            for index in range(len(self.init_specs)):
                if not await self._run_init(index):
                    if self.stopping is None:
                        self.terminal_phase = "Failed"
                        await self.push()
                    return
            self.initialized = True
            started = time.monotonic()
            loops = [asyncio.create_task(self._container_loop(i))
                     for i in range(len(self.specs))]
            await asyncio.gather(*loops)
            if self._restart_all is None or self.stopping is not None:
                break
            if time.monotonic() - started > 2 * self.settings.backoff_max_seconds:
                restarts = 0
            await self._restart_all_containers(restarts)
            restarts += 1
        if self.terminal_phase is None and self.stopping is None:
            self.terminal_phase = ps.final_phase(self.records)
            await self.push()

    async def _run_init(self, index: int) -> bool:
        record, spec = self.init_records[index], self.init_specs[index]
        attempt = 0
        while True:
            code = await self._run_once(record, spec)
            if code is None and self.stopping is None:
                await self._sync_back_off()
                continue
            if code is None or self.stopping is not None:
                return False
            if code == 0:
                await self.push()
                return True
            if self.restart_policy == "Never":
                return False
            await self._back_off(record, attempt)
            attempt += 1
            if self.stopping is not None:
                return False

    async def _container_loop(self, index: int) -> None:
        record, spec = self.records[index], self.specs[index]
        attempt = 0
        while self.stopping is None and self._restart_all is None:
            started = time.monotonic()
            code = await self._run_once(record, spec)
            if code is None:
                # Cannot start (image, config): the pod worker tries again later.
                await self._sync_back_off()
                continue
            if self.stopping is not None or self._restart_all is not None:
                return
            action = restart_on_exit(spec, self.restart_policy, code, self.gates)
            if action is OnExit.RESTART_ALL:
                self._begin_restart_all(record.name, code)
                return
            if action is OnExit.STOP:
                await self.push()
                return
            if time.monotonic() - started > 2 * self.settings.backoff_max_seconds:
                attempt = 0  # it ran fine for a long while: start the back-off over
            await self._back_off(record, attempt)
            attempt += 1

    async def _back_off(self, record: ps.ContainerRecord, attempt: int) -> None:
        record.last_state = {"terminated": record.terminated} if record.terminated else {}
        if attempt == 0:
            # doBackOff (pkg/kubelet/kuberuntime/kuberuntime_manager.go): a container with no
            # back-off entry yet is started again at once, and the entry is created (Next)
            # with the initial delay; only the exits after that wait (IsInBackOffSince).
            record.restart_count += 1
            return
        delay = min(self.settings.backoff_base_seconds * 2**(attempt - 1),
                    self.settings.backoff_max_seconds)
        record.wait("CrashLoopBackOff",
                    f"back-off {delay:g}s restarting failed container={record.name} "
                    f"pod={self.name}_{self.namespace}({self.uid})")
        await self.push()
        self._event("BackOff", f"Back-off restarting failed container {record.name} in pod "
                    f"{self.name}_{self.namespace}({self.uid})", warning=True,
                    container=record.name)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                self._first_of(self._stop_requested, self._restart_all_requested), delay)
        if self.stopping is None and self._restart_all is None:
            record.restart_count += 1

    async def _sync_back_off(self) -> None:
        """A sync that could not start a container is retried after the pod worker's
        back-off (`backOffPeriod`, 10 s: pkg/kubelet/kubelet.go; `completeWork` in
        pod_workers.go), unless the pod is stopped meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                self._first_of(self._stop_requested, self._restart_all_requested),
                SYNC_ERROR_BACK_OFF_SECONDS)

    @staticmethod
    async def _first_of(*events: asyncio.Event) -> None:
        waits = [asyncio.create_task(e.wait()) for e in events]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    # --- RestartAllContainers (KEP-5532 "Restart Phases") ---------------------------------
    def _set_own_condition(self, cond: dict[str, Any]) -> None:
        self.own_conditions = [c for c in self.own_conditions if c["type"] != cond["type"]]
        self.own_conditions.append(cond)

    def _begin_restart_all(self, container: str, code: int) -> None:
        """Termination phase: kill every container at once, no grace, no preStop."""
        self._restart_all = (f"Container {container} exited with code {code}, "
                             f"triggering pod restart")
        self._set_own_condition(ps.condition(ALL_CONTAINERS_RESTARTING, True, "ContainerExited",
                                             self._restart_all))
        self._restart_all_requested.set()
        for proc in list(self.processes.values()):
            proc.signal_group(signal.SIGKILL)

    async def _restart_all_containers(self, attempt: int) -> None:
        """Containers are gone: clear the condition and start over from the init containers,
        in the same pod (uid, IP, volumes kept); every container's restart count grows."""
        message = self._restart_all or ""
        await self.push()
        # The crash-loop back-off paces pod restarts as it does container restarts
        # (KEP-5532 "Unintended Pod Restart Loops"), with the same delays as `_back_off`.
        delay = min(self.settings.backoff_base_seconds * 2**attempt,
                    self.settings.backoff_max_seconds)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop_requested.wait(), delay)
        if self.stopping is not None:
            return
        for record in [*self.init_records, *self.records]:
            if record.terminated is None:
                record.terminate(137, "Error")
            record.prepare_restart()
            record.wait("PodInitializing" if self.init_specs else "ContainerCreating")
        self._set_own_condition(ps.condition(ALL_CONTAINERS_RESTARTING, False,
                                             "ContainerExited", message))
        self._restart_all = None
        self._restart_all_requested.clear()
        await self.push()

    async def _run_once(self, record: ps.ContainerRecord, spec: Mapping[str, Any]) -> int | None:
        """Run the container to its end; its exit code, or None if it cannot start at all."""
        layout = self.settings.layout
        ns, name, cname = self.namespace, self.name, record.name
        if self.stopping is not None:
            return None
        try:
            configmaps, secrets = await env_sources(self.client, self.namespace,
                                                    self.pod["spec"])
            env = container_env_of(self.settings, self.pod, spec, self.pod_ip, self.host_ip,
                                   configmaps, secrets, self.volumes)
        except EnvError as err:
            self._event("Failed", f"Error: {err}", warning=True, container=cname)
            record.wait("CreateContainerConfigError", str(err))
            await self.push()
            return None
        if self.stopping is not None:
            return None
        term_path = layout.termination_log(ns, name, cname)
        term_path.unlink(missing_ok=True)
        container = self.runtime.container(env)
        pid = await container.start()
        self._event("Started", f"Started container {cname}", container=cname)
        self.processes[cname] = container
        record.start(f"{self.runtime.scheme}://{pid}")
        await self.push()
        code = ps.exit_code(await container.wait())
        self.processes.pop(cname, None)
        record.terminate(code, ps.termination_reason(code, container.oom_killed),
                         termination_message(term_path))
        return code

    async def _stop(self, main: asyncio.Task[None]) -> None:
        kind = self.stopping
        if kind is Stop.NODE_SHUTDOWN and self.terminal_phase is not None:
            return  # the shutdown manager leaves finished pods alone
        if kind is Stop.NODE_SHUTDOWN:
            # Sent with the terminal phase, once no container runs: the status manager holds
            # DisruptionTarget back until then (`mergePodStatus`, pkg/kubelet/status/
            # status_manager.go). The early sign of a shutdown is the Node's Ready=False.
            self.own_conditions = [ps.condition(d.DISRUPTION_TARGET, True,
                                                d.REASON_TERMINATION_BY_KUBELET,
                                                d.NODE_SHUTDOWN_MESSAGE)]
        grace = 0.0 if kind is Stop.NODE_LOST else self._grace
        if not self.silent:
            for cname in self.processes:
                self._event("Killing", f"Stopping container {cname}", container=cname)
        await asyncio.gather(*(p.terminate(grace) for p in list(self.processes.values())))
        # Container loops notice the stop and return once they have recorded exit codes.
        await main
        for record in [*self.init_records, *self.records]:
            if not record.terminated:
                record.terminate(137, "ContainerStatusUnknown",
                                 "The container could not be located when the pod was terminated")
        if kind is Stop.NODE_SHUTDOWN:
            self.terminal_phase = "Failed"
            self.reason, self.message = d.NODE_SHUTDOWN_REASON, d.NODE_SHUTDOWN_MESSAGE
            await self.push()
        elif kind is Stop.DEADLINE:
            self.terminal_phase = "Failed"
            self.reason = "DeadlineExceeded"
            self.message = "Pod was active on the node longer than the specified deadline"
            await self.push()
        elif kind is Stop.DELETED:
            if self.terminal_phase is None:
                self.terminal_phase = ps.final_phase(self.records)
            await self.push()
            # The kubelet finalizes a deleted pod once its containers are gone and its
            # volumes are torn down (status manager `canBeDeleted`).
            with contextlib.suppress(ApiError):
                await self.client.delete(core_path("pods", self.namespace, self.name), 0)

    def _event(self, reason: str, message: str, *, warning: bool = False,
               container: str | None = None) -> None:
        if not self.silent:
            self.events.pod(self.pod, reason, message, warning=warning, host=self.node_name,
                            container=container)

    # --- status --------------------------------------------------------------------------
    def phase(self) -> str:
        """The phase this kubelet reports for the pod (what the status manager holds)."""
        if self.terminal_phase is not None:
            return self.terminal_phase
        if not self.initialized:
            return "Pending"
        return ps.running_phase(self.records, self.restart_policy) or ps.final_phase(self.records)

    def counts_for_admission(self) -> bool:
        if self.stopping is Stop.REMOVED:
            # Gone from the API (a forced delete): `HandlePodRemoves` drops it from the pod
            # manager at once, and admission lists only the pod manager's pods.
            return False
        # Stopping, nothing restarts: once every container has exited the termination is
        # complete (upstream's `completeTerminating` comes before the status manager sends
        # the terminal phase, which the scheduler acts on).
        stopped = self.stopping is not None and all(r.terminated for r in self.records)
        return admission.holds_resources(
            self.phase(), termination_requested=self.stopping is not None,
            terminated=self.terminated or stopped or self.done.is_set())

    def render(self, current: Mapping[str, Any]) -> dict[str, Any]:
        phase = self.phase()
        # DisruptionTarget only with a terminal phase (`mergePodStatus`, see `_stop`).
        own = [c for c in self.own_conditions
               if c["type"] != d.DISRUPTION_TARGET or self.terminal_phase is not None]
        desired = [*ps.readiness_conditions(self.records, phase, self.initialized), *own]
        existing = (current.get("status") or {}).get("conditions") or []
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": ps.merge_conditions(existing, desired),
            "hostIP": self.host_ip,
            "hostIPs": [{"ip": self.host_ip}],
            "podIP": self.pod_ip,
            "podIPs": [{"ip": self.pod_ip}],
            "startTime": self.start_time,
            "containerStatuses": [r.to_json() for r in self.records],
            "qosClass": (current.get("status") or {}).get("qosClass") or "BestEffort",
        }
        if self.init_records:
            status["initContainerStatuses"] = [r.to_json() for r in self.init_records]
        if self.reason:
            status["reason"] = self.reason
            status["message"] = self.message or ""
        return status

    async def push(self) -> None:
        """Write the pod's status (a conditional patch on the version read). Conflicts are
        read again; errors are retried with a growing pause, as the kubelet's status manager
        retries its writes: a 403 among them is the Node authorizer's graph not knowing yet
        that the pod is bound here (it follows the pod watch a moment behind), after which
        the same write is allowed."""
        async with self._push_lock:
            path = core_path("pods", self.namespace, self.name)
            delay, waited = STATUS_RETRY_FIRST_SECONDS, 0.0
            while not self.silent:
                try:
                    current = await self.client.get(path)
                    if current is None or current["metadata"].get("uid", self.uid) != self.uid:
                        return
                    body = {"metadata": {"resourceVersion":
                                         current["metadata"].get("resourceVersion")},
                            "status": self.render(current)}
                    await self.client.patch(path + "/status", body)
                    return
                except ApiError as err:
                    if err.status == 404:
                        return
                    if err.status == 409:
                        continue
                    if waited >= STATUS_RETRY_SECONDS:
                        log.warning("pod %s/%s: status write failed: %s", self.namespace,
                                    self.name, err)
                        return
                await asyncio.sleep(delay)
                waited += delay
                delay = min(delay * 2, STATUS_RETRY_MAX_SECONDS)
