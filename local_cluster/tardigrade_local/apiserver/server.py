"""The API server process: an aiohttp app on loopback, with optional state persistence."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml
from aiohttp import web

from .core import CRD_KEY, Core
from .gc import GarbageCollector
from .handlers import Handlers
from .resources import Registry
from .store import Store

log = logging.getLogger(__name__)

STATE_FILE = "apiserver-state.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ApiServer:
    """A local Kubernetes API server.

    Use as `async with ApiServer() as server: ... server.url ...`, or `await start()` /
    `await stop()`. With `state_dir`, objects are saved to a JSON snapshot (periodically and on
    stop) and loaded again on start, so a restart keeps the cluster's state.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 state_dir: str | Path | None = None, crd_paths: list[str | Path] | None = None,
                 history_size: int = 10_000, bookmark_interval: float = 10.0,
                 snapshot_interval: float = 2.0, access_log: bool = False) -> None:
        self.host = host
        # Port 0 binds an ephemeral port at start (no race with other processes); `url`
        # is final once `start()` returns.
        self.port = port
        self.state_dir = Path(state_dir) if state_dir else None
        self.crd_paths = [Path(p) for p in crd_paths or []]
        self.store = Store(history_size)
        self.registry = Registry()
        self.core = Core(self.store, self.registry)
        self.handlers = Handlers(self.core, self.store, bookmark_interval)
        self.gc: GarbageCollector | None = None
        self.snapshot_interval = snapshot_interval
        self.access_log = access_log
        self._runner: web.AppRunner | None = None
        self._snapshot_task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=4 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handlers.dispatch)
        return app

    async def start(self) -> ApiServer:
        self._load_state()
        self.core.bootstrap()
        self._load_crds()
        self.gc = GarbageCollector(self.core)
        self.gc.start()
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

    async def _start_serving(self) -> None:
        from aiohttp.web_log import AccessLogger

        self._runner = web.AppRunner(self.make_app(),
                                     access_log=log if self.access_log else None,
                                     access_log_class=AccessLogger,
                                     handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        if self.port == 0:
            server = site._server
            assert server is not None
            self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def _stop_serving(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

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
                     namespace: str = "default", user: str | None = None,
                     token: str = "tardigrade-local") -> Path:
    """A kubeconfig pointing at `url` (plain HTTP on loopback; the server checks no token)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    user = user or context
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": url}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": user,
                                                   "namespace": namespace}}],
        "current-context": context,
        "preferences": {},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
