"""The API server process: an aiohttp app on loopback, with optional state persistence."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import ssl
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml
from aiohttp import web

from . import ownerrefs
from .access import UNSECURED, Access, AuditLog
from .authn import Authenticator, Keys
from .core import CRD_KEY, Core
from .decoding import allow_deep_objects
from .featuregates import FeatureGates
from .gc import GarbageCollector
from .handlers import Handlers
from .policy import ensure_bootstrap_policy
from .resources import Registry
from .store import Store
from .tls import ensure_serving_cert, server_context

log = logging.getLogger(__name__)

STATE_FILE = "apiserver-state.json"
KEYS_FILE = "apiserver-keys.json"


class ApiServer:
    """A local Kubernetes API server.

    Use as `async with ApiServer() as server: ... server.url ...`, or `await start()` /
    `await stop()`. With `state_dir`, objects are saved to a JSON snapshot (periodically and on
    stop) and loaded again on start, so a restart keeps the cluster's state.

    `authorization_mode`: "AlwaysAllow" (upstream's default) or "RBAC". Clients with
    `admin_token` are in `system:masters` either way (see `access.py`); `audit_log`: a file
    that gets one JSON line per authorization decision. With `secure_port` (0: any free
    port), the server also listens with TLS there (`secure_url`, certificate `ca_pem`, made
    in `pki_dir`) and authenticates and authorizes only that port: the plain port becomes
    the all-powerful insecure port (see `access.py`). `admission_plugins`: plugins off by
    default upstream to turn on ("OwnerReferencesPermissionEnforcement", see `ownerrefs.py`).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 state_dir: str | Path | None = None, crd_paths: list[str | Path] | None = None,
                 history_size: int = 10_000, bookmark_interval: float = 10.0,
                 snapshot_interval: float = 2.0, access_log: bool = False,
                 authorization_mode: str = "AlwaysAllow",
                 audit_log: str | Path | None = None, secure_port: int | None = None,
                 pki_dir: str | Path | None = None,
                 admission_plugins: tuple[str, ...] = (),
                 feature_gates: FeatureGates | None = None) -> None:
        self.host = host
        # Port 0 binds an ephemeral port at start (no race with other processes); `url`
        # is final once `start()` returns.
        self.port = port
        self.state_dir = Path(state_dir) if state_dir else None
        self.crd_paths = [Path(p) for p in crd_paths or []]
        self.store = Store(history_size)
        self.registry = Registry()
        self.core = Core(self.store, self.registry)
        self.core.feature_gates = feature_gates or FeatureGates()
        self.secure_port = secure_port
        self.pki_dir = Path(pki_dir) if pki_dir else None
        self.ca_pem: str | None = None
        self._ssl: ssl.SSLContext | None = None
        self.keys = self._load_keys()
        audit = AuditLog(Path(audit_log)) if audit_log else None
        self.access = Access(Authenticator(self.store, self.keys), authorization_mode, audit)
        self.handlers = Handlers(self.core, self.store, self.access, bookmark_interval)
        for plugin in admission_plugins:
            self._enable_admission(plugin)
        self.gc: GarbageCollector | None = None
        self.snapshot_interval = snapshot_interval
        self.access_log = access_log
        self._runners: list[web.AppRunner] = []
        self._snapshot_task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def admin_token(self) -> str:
        """A bearer token of user `admin` in group `system:masters`."""
        return self.keys.admin_token

    def write_kubeconfig(self, path: str | Path, url: str | None = None,
                         **options: Any) -> Path:
        """An admin kubeconfig for this server (its plain port unless `url` says otherwise;
        see `write_kubeconfig` for `options`)."""
        return write_kubeconfig(path, url or self.url, token=self.admin_token, **options)

    def _load_keys(self) -> Keys:
        """The admin token and signing key; kept in `state_dir` so that kubeconfigs and pod
        tokens stay valid across restarts (as the key files of kube-apiserver do)."""
        path = self.state_dir / KEYS_FILE if self.state_dir is not None else None
        if path is not None and path.exists():
            return Keys.from_json(json.loads(path.read_text()))
        keys = Keys()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(keys.as_json()))
            path.chmod(0o600)
        return keys

    @property
    def secure_url(self) -> str | None:
        return f"https://{self.host}:{self.secure_port}" if self._ssl is not None else None

    def make_app(self, unsecured: bool = False) -> web.Application:
        app = web.Application(client_max_size=4 * 1024 * 1024)
        app[UNSECURED] = unsecured
        app.router.add_route("*", "/{tail:.*}", self.handlers.dispatch)
        return app

    def _enable_admission(self, plugin: str) -> None:
        """`--enable-admission-plugins`: only those that differ from upstream's defaults."""
        if plugin != ownerrefs.NAME:
            raise ValueError(f"unknown admission plugin {plugin!r}: this server emulates "
                             f"{ownerrefs.NAME} only")
        if self.access.rbac is None:
            raise ValueError(f"{plugin} authorizes requests: it needs authorization_mode RBAC")
        self.core.admission.append(ownerrefs.OwnerReferencesPermissionEnforcement(
            self.registry, self.access.authorize))

    def _setup_tls(self) -> None:
        if self.secure_port is None or self._ssl is not None:
            return
        pki = self.pki_dir or (self.state_dir / "pki" if self.state_dir else None)
        if pki is None:
            pki = Path(tempfile.mkdtemp(prefix="apiserver-pki-"))
        cert, key = ensure_serving_cert(pki)
        self.ca_pem = cert.read_text()
        self._ssl = server_context(cert, key)

    async def start(self) -> ApiServer:
        # Objects as deep as a real server stores must not end in RecursionError here.
        allow_deep_objects()
        self._load_state()
        self.core.bootstrap()
        if self.access.mode == "RBAC":
            ensure_bootstrap_policy(self.core)
        self._load_crds()
        self.gc = GarbageCollector(self.core)
        self.gc.start()
        self._setup_tls()
        await self._start_serving()
        if self.state_dir is not None:
            self._snapshot_task = asyncio.create_task(self._snapshot_loop())
        log.info("API server listening on %s", self.url)
        return self

    async def stop(self) -> None:
        if self._snapshot_task is not None:
            self._snapshot_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._snapshot_task
        self.store.close_watchers()
        await self._stop_serving()
        if self.gc is not None:
            await self.gc.stop()
        if self.access.audit is not None:
            self.access.audit.close()
        self.save_state()

    async def restart(self, downtime_seconds: float = 0.0, expire_history: bool = True) -> None:
        """What clients see of a kube-apiserver restart: every connection drops, the port
        refuses connections for `downtime_seconds`, then the same objects are served under the
        same resourceVersions (etcd keeps them). The new server's watch cache starts empty, so
        a watch resumed from before the restart gets 410 Gone and must relist, unless
        `expire_history` is False."""
        self.store.cut_watchers()
        await self._stop_serving()
        if expire_history:
            self.store.compact()
        await asyncio.sleep(downtime_seconds)
        await self._start_serving()
        log.info("API server restarted on %s", self.url)

    def cut_watches(self, expire_history: bool = False) -> int:
        """Drop every open watch connection; with `expire_history`, resuming from an old
        resourceVersion then answers 410 Gone (as after an etcd compaction)."""
        if expire_history:
            self.store.compact()
        return self.store.cut_watchers()

    async def _serve_on(self, port: int, unsecured: bool,
                        ssl_context: ssl.SSLContext | None) -> int:
        from aiohttp.web_log import AccessLogger

        runner = web.AppRunner(self.make_app(unsecured),
                               access_log=log if self.access_log else None,
                               access_log_class=AccessLogger,
                               handler_cancellation=True, shutdown_timeout=1.0)
        await runner.setup()
        self._runners.append(runner)
        site = web.TCPSite(runner, self.host, port, reuse_address=True, ssl_context=ssl_context)
        await site.start()
        server = site._server
        assert server is not None
        return int(server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def _start_serving(self) -> None:
        # With a TLS port, the plain port is the insecure one: no authentication.
        self.port = await self._serve_on(self.port, self._ssl is not None, None)
        if self._ssl is not None and self.secure_port is not None:
            self.secure_port = await self._serve_on(self.secure_port, False, self._ssl)

    async def _stop_serving(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners = []

    async def __aenter__(self) -> ApiServer:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    # ---- state ------------------------------------------------------------------------------
    def save_state(self) -> None:
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self.store.snapshot(self.state_dir / STATE_FILE)

    def _load_state(self) -> None:
        if self.state_dir is None:
            return
        path = self.state_dir / STATE_FILE
        if path.exists():
            for crd in self.store.restore(path):
                self.core.register_crd(crd)

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.snapshot_interval)
            if self.store.dirty:
                self.save_state()

    def _load_crds(self) -> None:
        """Register CRDs from files or directories (e.g. the repository's `crds/`)."""
        rt = self.registry.get("apiextensions.k8s.io", "v1", "customresourcedefinitions")
        assert rt is not None
        for base in self.crd_paths:
            files = sorted(base.glob("*.y*ml")) if base.is_dir() else [base]
            for file in files:
                for doc in yaml.safe_load_all(file.read_text()):
                    if not doc or doc.get("kind") != "CustomResourceDefinition":
                        continue
                    name = doc["metadata"]["name"]
                    current = self.store.get(CRD_KEY, "", name)
                    if current is None:
                        self.core.create(rt, None, doc)
                    elif current.get("spec") != doc.get("spec"):
                        # The file changed since the state was saved: the file wins.
                        current["spec"] = doc["spec"]
                        self.core.update(rt, "", name, current, current=self.store.get(
                            CRD_KEY, "", name))

    def create_object(self, api_version: str, kind: str, body: dict[str, Any],
                      namespace: str | None = None) -> dict[str, Any]:
        """Create an object in-process (for fixtures), with the same rules as a POST."""
        rt = self.registry.by_kind(api_version, kind)
        if rt is None:
            raise KeyError(f"unknown kind {api_version} {kind}")
        return self.core.create(rt, namespace, body)


def write_kubeconfig(path: str | Path, url: str, context: str = "tardigrade-local",
                     namespace: str = "default", user: str | None = None, *,
                     token: str, ca_pem: str | None = None) -> Path:
    """A kubeconfig pointing at `url` with a bearer `token`; `ca_pem`: the CA certificate
    an https `url` is checked against."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    user = user or context
    cluster: dict[str, Any] = {"server": url}
    if ca_pem is not None:
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem.encode()).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": cluster}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": user,
                                                   "namespace": namespace}}],
        "current-context": context,
        "preferences": {},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
