"""The real Kubernetes control plane as local processes: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler, built from the pinned modules (`gobuild.py`).

Started in the order a cluster needs them (`ControlPlane.start`): etcd; kube-apiserver on a
secure port with a CA of its own; the CRDs, once it is ready, so that the controller
manager's garbage collector finds them in its first discovery (it reads discovery again
only every 30 s, `garbagecollector.go` `Sync` with `--controllers` defaults); the RBAC of our
own identities (`identities.py`); then the controller manager and the scheduler. Every port
is a free one, so clusters run side by side (a port another process takes between its pick
and the component's bind is picked again, `BIND_ATTEMPTS`). Every process is told to die with its
supervisor (`PR_SET_PDEATHSIG`), so a killed cluster leaves none behind.

Which flag each `ControlPlaneSettings` field sets, and which upstream constants cannot be
set, is tabled in `local_cluster/README.md` ("The control plane").
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import os
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tardigrade_local import crdwait, egressproxy, gobuild, identities, kueue, pki
from tardigrade_local.kubeconfig import write_kubeconfig
from tardigrade_local.lifetime import die_with_parent
from tardigrade_local.ports import free_port

log = logging.getLogger(__name__)

SERVICE_CIDR = "10.0.0.0/24"
# The `kubernetes` Service's ClusterIP: the first address of the range.
KUBERNETES_SERVICE_IP = "10.0.0.1"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
READY_TIMEOUT_SECONDS = 90.0
# `free_port` checks a port free and the component binds it a moment later: another process
# (a cluster starting beside this one) may bind it in between, and the component exits with
# Go's EADDRINUSE message. It is then started again on new ports, this many times in all.
BIND_ATTEMPTS = 5
ADDRESS_IN_USE = "bind: address already in use"
STOP_TIMEOUT_SECONDS = 10.0
# Controllers a cluster of loopback pods cannot run: EndpointSlice validation refuses
# loopback addresses (`ValidateEndpointSlice` -> `validateEndpoints` ->
# `ValidateEndpointIP`), so these would fail every sync of a Service that selects pods.
# Names from `kubectl`-less `kube-controller-manager --help`'s `--controllers` list.
DISABLED_CONTROLLERS = ("endpoints-controller", "endpointslice-controller",
                        "endpointslice-mirroring-controller")
# Admission plugins on top of kube-apiserver's defaults (`options/plugins.go`,
# `DefaultOffAdmissionPlugins` lists what is off): NodeRestriction, as every production
# cluster (GKE included) runs it with the Node authorizer, and
# OwnerReferencesPermissionEnforcement, so an operator that sets blockOwnerDeletion without
# `update` on its owner's finalizers fails here as it fails on the strictest clusters.
EXTRA_ADMISSION_PLUGINS = ("NodeRestriction", "OwnerReferencesPermissionEnforcement")
# Users whose requests the audit log leaves out: the control plane's own components and the
# cluster's administrator; everything else (operators, pods' service accounts, helm run as
# a service account, our `cloud` identity) is logged at Metadata level.
# kube-controller-manager's defaults: --node-monitor-grace-period (50 s since 1.32,
# kubernetes/kubernetes#126287) and --node-monitor-period (5 s).
NODE_MONITOR_GRACE_SECONDS = 50.0
NODE_MONITOR_PERIOD_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class ControlPlaneSettings:
    # kube-apiserver --feature-gates, `Name=true,...`, passed as given.
    feature_gates: str = ""
    # kube-controller-manager --node-monitor-period / --node-monitor-grace-period /
    # --node-startup-grace-period (upstream defaults 5 s, 50 s, 60 s).
    node_monitor_period_seconds: float = NODE_MONITOR_PERIOD_SECONDS
    node_monitor_grace_seconds: float = NODE_MONITOR_GRACE_SECONDS
    node_startup_grace_seconds: float = 60.0
    # kube-apiserver --default-not-ready-toleration-seconds and
    # --default-unreachable-toleration-seconds (DefaultTolerationSeconds admission; 300).
    default_toleration_seconds: int = 300
    # kube-controller-manager --terminated-pod-gc-threshold (12500).
    terminated_pod_gc_threshold: int = 12500
    # Client rate limits of the controller manager and the scheduler (their defaults: 20
    # QPS, burst 30, kcm; 50 / 100, scheduler). Benches with a thousand pods raise them.
    component_qps: float | None = None
    component_burst: int | None = None
    # The audit log (`--audit-log-path`), for tests that read what a client was allowed.
    audit: bool = True
    # kube-apiserver reaches kubelets and webhooks through `egressproxy.py` (its egress
    # selector), which can enter real nodes' network namespaces (`realnode.py`).
    node_egress: bool = False
    # Run the endpoint controllers (`DISABLED_CONTROLLERS`): only for pods with real
    # addresses (real nodes), whose Services kube-proxy and CoreDNS serve.
    endpoint_controllers: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ControlPlaneSettings:
        return cls(**data)


def _seconds(value: float) -> str:
    """A Go duration flag value."""
    return f"{int(value * 1000)}ms"


class ComponentError(RuntimeError):
    pass


class Component:
    """One process of the control plane, restartable with the same command line."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        # Where this start's output begins in the log (a restart appends to it).
        self._log_offset = 0

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdout=out, stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL, preexec_fn=die_with_parent)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def exited(self) -> bool:
        return self.proc is None or self.proc.returncode is not None

    def output(self) -> str:
        """What the process wrote to its log since its last start."""
        if not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as log_file:
            log_file.seek(self._log_offset)
            return log_file.read().decode(errors="replace")

    def lost_its_port(self) -> bool:
        """Whether it exited because a port it was to listen on was taken."""
        return self.exited() and ADDRESS_IN_USE in self.output()

    def failure(self) -> str:
        tail = self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""
        code = None if self.proc is None else self.proc.returncode
        return f"{self.name} exited with {code}; the end of {self.log_path}:\n{tail}"

    async def stop(self, timeout: float = STOP_TIMEOUT_SECONDS) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


@dataclasses.dataclass(frozen=True)
class Endpoints:
    etcd_url: str
    api_url: str


class ControlPlane:
    """`async with ControlPlane(root, settings) as plane: plane.api_url, plane.admin_kubeconfig`.

    `root` holds the PKI, etcd's data, the kubeconfigs and each component's log."""

    def __init__(self, root: Path, settings: ControlPlaneSettings | None = None,
                 crd_files: Sequence[Path] = (), kueue: bool = False,
                 kueue_wait_for_pods_ready: kueue.WaitForPodsReady | None = None) -> None:
        self.root = root
        # Kueue's CRDs and webhooks go in with ours, before the controller manager starts
        # (its garbage collector must know Workloads from its first discovery); its manager
        # starts after (`start_kueue`).
        self.kueue = kueue
        self.kueue_wait_for_pods_ready = kueue_wait_for_pods_ready
        self._kueue_ports: kueue.KueuePorts | None = None
        self.settings = settings or ControlPlaneSettings()
        self.crd_files = list(crd_files)
        self.pki_dir = root / "pki"
        self.logs_dir = root / "logs"
        self.components: dict[str, Component] = {}
        self.ca: pki.Authority | None = None
        self.etcd_port = 0
        self.api_port = 0

    # --- facts ---------------------------------------------------------------------------
    @property
    def api_url(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def egress_socket(self) -> Path:
        return self.root / "egress.sock"

    @property
    def egress_routes(self) -> Path:
        """Where real nodes say which network namespace their address is in
        (`egressproxy.py`)."""
        return self.root / "egress-routes"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_port}"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def ca_pem(self) -> bytes:
        assert self.ca is not None
        return self.ca.cert_pem

    @property
    def ca_file(self) -> Path:
        return self.pki_dir / "ca.crt"

    def pids(self) -> dict[str, int]:
        return {name: c.pid for name, c in self.components.items() if c.pid is not None}

    def identity(self, name: str) -> tuple[Path, Path]:
        """(certificate, key) files of one of our identities (`identities.py`)."""
        return self.pki_dir / f"{name}.crt", self.pki_dir / f"{name}.key"

    def issue(self, name: str, common_name: str, organizations: Sequence[str] = (), *,
              server: bool = False, ip_addresses: Sequence[str] = ()) -> tuple[Path, Path]:
        """A client (and with `server`, serving) certificate signed by the cluster CA."""
        assert self.ca is not None
        pair = self.ca.issue(common_name, organizations, server=server,
                             ip_addresses=ip_addresses)
        return pair.write(self.pki_dir, name)

    def ssl_context(self, identity: str) -> ssl.SSLContext:
        """A client TLS context that trusts the cluster CA and presents `identity`."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        cert, key = self.identity(identity)
        context.load_cert_chain(str(cert), str(key))
        return context

    def kubeconfig_for(self, identity: str, path: Path, user: str | None = None) -> Path:
        cert, key = self.identity(identity)
        return write_kubeconfig(path, self.api_url, user=user or identity,
                                ca_pem=self.ca_pem, client_cert_pem=cert.read_bytes(),
                                client_key_pem=key.read_bytes())

    # --- lifecycle -----------------------------------------------------------------------
    async def __aenter__(self) -> ControlPlane:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        started = time.monotonic()
        self.etcd_port, self.api_port = free_port(), free_port()
        await asyncio.to_thread(self._write_pki)
        self._write_kubeconfigs()
        await self._start_on_free_ports("etcd", self._etcd_argv, self._etcd_healthy,
                                        self._new_etcd_port)
        if self.settings.node_egress:
            self.components["egress-proxy"] = Component(
                "egress-proxy", [sys.executable, "-m", "tardigrade_local.egressproxy",
                                 str(self.egress_socket), str(self.egress_routes)],
                self.logs_dir / "egress-proxy.log")
            await self.components["egress-proxy"].start()
            await self._wait("egress-proxy", self._egress_ready)
        await self._start_on_free_ports("kube-apiserver", self._apiserver_argv, self._api_ready,
                                        self._new_api_port)
        log.info("kube-apiserver ready after %.1f s", time.monotonic() - started)
        async with self.admin_session() as session:
            await identities.install(session, self.api_url)
            await self._install_crds(session)
            if self.kueue:
                await self._install_kueue(session)
        for name, argv in (("kube-controller-manager", self._controller_manager_argv()),
                           ("kube-scheduler", self._scheduler_argv())):
            self.components[name] = Component(name, argv, self.logs_dir / f"{name}.log")
            await self.components[name].start()
        # Pods need their namespace's `default` ServiceAccount (the ServiceAccount admission
        # plugin refuses them until the controller manager made it).
        await self._wait("kube-controller-manager", self._default_service_account)
        log.info("control plane ready after %.1f s", time.monotonic() - started)

    async def _start_on_free_ports(self, name: str, argv: Callable[[], list[str]],
                                   ready: Callable[[], Awaitable[bool]],
                                   new_ports: Callable[[], None]) -> None:
        """Start component `name` with the command line `argv()` and wait until `ready`; if
        it exits because a port picked for it was taken meanwhile, `new_ports()` picks
        others and it starts again (BIND_ATTEMPTS in all). Any other failure is raised."""
        for attempt in range(1, BIND_ATTEMPTS + 1):
            component = Component(name, argv(), self.logs_dir / f"{name}.log")
            self.components[name] = component
            await component.start()
            try:
                await self._wait(name, ready)
                return
            except ComponentError:
                if attempt == BIND_ATTEMPTS or not component.lost_its_port():
                    raise
            log.warning("%s exited: a port picked for it was taken meanwhile (attempt %d of "
                        "%d); starting it on new ports", name, attempt, BIND_ATTEMPTS)
            new_ports()

    def _new_etcd_port(self) -> None:
        self.etcd_port = free_port()  # the peer port is picked anew by `_etcd_argv`

    def _new_api_port(self) -> None:
        self.api_port = free_port()
        self._write_kubeconfigs()  # they hold the API server's URL

    async def _install_kueue(self, session: Any) -> None:
        """Kueue's CRDs, RBAC and webhooks from its module's manifests (`kueue.py`)."""
        source = await asyncio.to_thread(kueue.module_source)
        self._kueue_ports = kueue.KueuePorts()
        await kueue.install(session, self.api_url, source, self._kueue_ports.webhook_url,
                            self.ca_pem)

    async def start_kueue(self) -> None:
        """Kueue's manager, waited for until its webhooks serve (its objects are installed
        in `start`)."""
        started = time.monotonic()
        ports = self._kueue_ports
        assert self.ca is not None and ports is not None, "ControlPlane(kueue=True) first"
        await asyncio.to_thread(kueue.ensure_metrics_certificate, self.ca)
        directory = self.root / "kueue"
        cert_dir = directory / "certs"
        self.ca.issue("kueue-webhook", client=False, server=True,
                      ip_addresses=("127.0.0.1",)).write(cert_dir, "tls")
        self.issue(kueue.IDENTITY.name, kueue.IDENTITY.common_name,
                   kueue.IDENTITY.organizations)
        kubeconfig = self.kubeconfig_for(kueue.IDENTITY.name, directory / "kubeconfig",
                                         user=kueue.IDENTITY.common_name)
        config = directory / "config.yaml"
        config.write_text(yaml.safe_dump(kueue.manager_config(
            ports.webhook, ports.health, cert_dir,
            wait_for_pods_ready=self.kueue_wait_for_pods_ready)))
        component = Component("kueue", [str(gobuild.binary("kueue")), f"--config={config}",
                                        f"--kubeconfig={kubeconfig}"],
                              self.logs_dir / "kueue.log")
        self.components["kueue"] = component
        await component.start()
        await kueue.wait_ready(ports.ready_url, component.exited, component.failure)
        log.info("Kueue ready after %.1f s", time.monotonic() - started)

    async def stop(self) -> None:
        # The API server's clients first, etcd last.
        for name in ("kueue", "kube-scheduler", "kube-controller-manager", "kube-apiserver",
                     "egress-proxy", "etcd"):
            component = self.components.get(name)
            if component is not None:
                await component.stop()

    async def restart_apiserver(self, downtime_seconds: float = 0.0, compact: bool = False
                                ) -> None:
        """Stop kube-apiserver, wait, start it again on the same port and wait until ready;
        with `compact`, etcd's history is compacted while it is down."""
        component = self.components["kube-apiserver"]
        await component.stop()
        if compact:
            await self.compact()
        await asyncio.sleep(downtime_seconds)
        await component.start()
        await self._wait("kube-apiserver", self._api_ready)

    async def compact(self) -> int:
        """Compact etcd's history up to now: a watch resumed from an older resourceVersion
        gets 410 Gone, as after etcd's periodic compaction (kube-apiserver compacts every
        5 min, `--etcd-compaction-interval`). Returns the revision compacted to."""
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{self.etcd_url}/v3/kv/range",
                                    json={"key": base64.b64encode(b"/").decode()}) as resp:
                revision = int((await resp.json())["header"]["revision"])
            async with session.post(f"{self.etcd_url}/v3/kv/compaction",
                                    json={"revision": revision, "physical": True}) as resp:
                if resp.status != 200:
                    raise ComponentError(f"etcd compaction failed: {await resp.text()}")
        return revision

    # --- command lines -------------------------------------------------------------------
    def _write_pki(self) -> None:
        if (self.pki_dir / "ca.crt").exists():
            self.ca = pki.Authority.load(self.pki_dir)
            return
        self.ca = pki.Authority.create()
        self.ca.key_pair().write(self.pki_dir, "ca")
        names, addresses = pki.serving_names(KUBERNETES_SERVICE_IP)
        self.ca.issue("kube-apiserver", client=False, server=True, dns_names=names,
                      ip_addresses=addresses).write(self.pki_dir, "apiserver")
        pki.signing_key().write(self.pki_dir, "service-account")
        for identity in identities.CLIENTS:
            self.ca.issue(identity.common_name, identity.organizations).write(
                self.pki_dir, identity.name)
        (self.root / "audit-policy.yaml").write_text(yaml.safe_dump(identities.AUDIT_POLICY))

    def _write_kubeconfigs(self) -> None:
        for identity in identities.CLIENTS:
            self.kubeconfig_for(identity.name, self.root / f"{identity.name}.kubeconfig",
                                user=identity.common_name)
        admin = self.root / f"{identities.ADMIN.name}.kubeconfig"
        self.admin_kubeconfig.write_bytes(admin.read_bytes())
        self.admin_kubeconfig.chmod(0o600)

    def _etcd_argv(self) -> list[str]:
        peer = f"http://127.0.0.1:{free_port()}"
        return [str(gobuild.binary("etcd")), "--name", "local", "--data-dir",
                str(self.root / "etcd"), "--listen-client-urls", self.etcd_url,
                "--advertise-client-urls", self.etcd_url, "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer, "--initial-cluster", f"local={peer}",
                # What envtest does: a test cluster's data does not outlive the machine.
                "--unsafe-no-fsync", "--log-level", "warn"]

    def _apiserver_argv(self) -> list[str]:
        s, p = self.settings, self.pki_dir
        argv = [
            str(gobuild.binary("kube-apiserver")),
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.api_port}",
            f"--tls-cert-file={p / 'apiserver.crt'}",
            f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={p / 'ca.crt'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={p / 'service-account.crt'}",
            f"--service-account-signing-key-file={p / 'service-account.key'}",
            "--authorization-mode=Node,RBAC",
            f"--enable-admission-plugins={','.join(EXTRA_ADMISSION_PLUGINS)}",
            "--allow-privileged=true",
            # The API server reaches kubelets (logs) at their InternalIP, with a client
            # certificate, and checks their serving certificates against our CA.
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={p / 'ca.crt'}",
            # The `kubernetes` Service's endpoints would be this loopback address, which
            # EndpointSlice validation refuses (as for pods, DISABLED_CONTROLLERS).
            "--endpoint-reconciler-type=none",
            f"--default-not-ready-toleration-seconds={s.default_toleration_seconds}",
            f"--default-unreachable-toleration-seconds={s.default_toleration_seconds}",
            "--profiling=false",
        ]
        if s.feature_gates:
            argv.append(f"--feature-gates={s.feature_gates}")
        if s.node_egress:
            config = self.root / "egress-selector.yaml"
            config.write_text(egressproxy.egress_config(self.egress_socket))
            argv.append(f"--egress-selector-config-file={config}")
        if s.audit:
            argv += [f"--audit-policy-file={self.root / 'audit-policy.yaml'}",
                     f"--audit-log-path={self.root / 'audit.log'}", "--audit-log-format=json",
                     "--audit-log-maxbackup=1"]
        return argv

    def _controllers_flag(self) -> str:
        if self.settings.endpoint_controllers:
            return "--controllers=*"
        return f"--controllers=*,{','.join('-' + c for c in DISABLED_CONTROLLERS)}"

    def _controller_manager_argv(self) -> list[str]:
        s, p = self.settings, self.pki_dir
        argv = [
            str(gobuild.binary("kube-controller-manager")),
            f"--kubeconfig={self.root / 'kube-controller-manager.kubeconfig'}",
            "--secure-port=0", "--leader-elect=false",
            # Each controller authenticates as its own ServiceAccount in kube-system, with
            # the `system:controller:*` roles, as kubeadm and GKE clusters run it.
            "--use-service-account-credentials=true",
            f"--root-ca-file={p / 'ca.crt'}",
            f"--service-account-private-key-file={p / 'service-account.key'}",
            self._controllers_flag(),
            f"--node-monitor-period={_seconds(s.node_monitor_period_seconds)}",
            f"--node-monitor-grace-period={_seconds(s.node_monitor_grace_seconds)}",
            f"--node-startup-grace-period={_seconds(s.node_startup_grace_seconds)}",
            f"--terminated-pod-gc-threshold={s.terminated_pod_gc_threshold}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--profiling=false",
        ]
        if s.feature_gates:
            argv.append(f"--feature-gates={s.feature_gates}")
        if s.component_qps is not None:
            argv.append(f"--kube-api-qps={s.component_qps:g}")
        if s.component_burst is not None:
            argv.append(f"--kube-api-burst={s.component_burst}")
        return argv

    def _scheduler_argv(self) -> list[str]:
        s = self.settings
        connection: dict[str, Any] = {
            "kubeconfig": str(self.root / "kube-scheduler.kubeconfig")}
        if s.component_qps is not None:
            connection["qps"] = s.component_qps
        if s.component_burst is not None:
            connection["burst"] = s.component_burst
        config = {"apiVersion": "kubescheduler.config.k8s.io/v1",
                  "kind": "KubeSchedulerConfiguration",
                  "clientConnection": connection,
                  "leaderElection": {"leaderElect": False}}
        path = self.root / "kube-scheduler-config.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = [str(gobuild.binary("kube-scheduler")), f"--config={path}", "--secure-port=0",
                "--profiling=false"]
        if s.feature_gates:
            argv.append(f"--feature-gates={s.feature_gates}")
        return argv

    # --- readiness -----------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def admin_session(self) -> Any:
        connector = aiohttp.TCPConnector(ssl=self.ssl_context(identities.ADMIN.name))
        async with aiohttp.ClientSession(connector=connector) as session:
            yield session

    async def _egress_ready(self) -> bool:
        return self.egress_socket.exists()

    async def _wait(self, name: str, check: Any) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        component = self.components[name]
        while True:
            if component.exited():
                raise ComponentError(component.failure())
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                if await check():
                    return
            if time.monotonic() > deadline:
                raise ComponentError(f"{name} not ready after {READY_TIMEOUT_SECONDS:.0f} s; "
                                     + component.failure())
            await asyncio.sleep(0.1)

    async def _etcd_healthy(self) -> bool:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(
                f"{self.etcd_url}/health") as resp:
            return resp.status == 200 and json.loads(await resp.text()).get("health") == "true"

    async def _api_ready(self) -> bool:
        async with self.admin_session() as session, session.get(f"{self.api_url}/readyz",
                               timeout=aiohttp.ClientTimeout(total=2)) as resp:
            return resp.status == 200

    async def _default_service_account(self) -> bool:
        url = f"{self.api_url}/api/v1/namespaces/default/serviceaccounts/default"
        async with self.admin_session() as session, session.get(
                url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
            return resp.status == 200

    async def _install_crds(self, session: aiohttp.ClientSession) -> None:
        """Create (or replace) the CRDs and wait until each is Established."""
        names = []
        base = f"{self.api_url}/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        for path in self.crd_files:
            for doc in yaml.safe_load_all(path.read_text()):
                if not doc or doc.get("kind") != "CustomResourceDefinition":
                    continue
                name = doc["metadata"]["name"]
                async with session.post(base, json=doc) as resp:
                    if resp.status == 409:
                        async with session.get(f"{base}/{name}") as current:
                            version = (await current.json())["metadata"]["resourceVersion"]
                        doc["metadata"]["resourceVersion"] = version
                        async with session.put(f"{base}/{name}", json=doc) as put:
                            if put.status >= 400:
                                raise ComponentError(f"CRD {name}: {await put.text()}")
                    elif resp.status >= 400:
                        raise ComponentError(f"CRD {name} from {path}: {await resp.text()}")
                names.append(name)
        try:
            await crdwait.wait_established(session, base, names, READY_TIMEOUT_SECONDS)
        except crdwait.NotEstablished as err:
            raise ComponentError(str(err)) from None


def cluster_processes(plane: ControlPlane) -> dict[str, int]:
    """The control plane's process ids by component (for CPU and memory accounting)."""
    return {**plane.pids(), "supervisor": os.getpid()}
