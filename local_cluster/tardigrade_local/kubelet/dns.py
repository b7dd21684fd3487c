"""Cluster DNS for local pods: the names a headless Service gives its pods, in a hosts file.

In a cluster CoreDNS answers `<hostname>.<subdomain>.<ns>.svc.cluster.local` from the
EndpointSlices of the headless Service named like the pod's subdomain. Here pods have
loopback addresses, which EndpointSlice validation refuses, so the endpoint controllers are
off (`controlplane.DISABLED_CONTROLLERS`) and this component answers from the pods and
Services themselves, with an identity and the read-only access CoreDNS's own role gives
(`identities.CLUSTER_DNS`). Pods read the file through `podsite/tardigrade_podnet.py`.

The file lists every pod, so rewriting it costs time in proportion to the pods: it is
rewritten once per burst of pod and Service events (`COALESCE_SECONDS` after the first event
of a burst, then no sooner than `REFRESH_SECONDS` after the last rewrite). Cluster DNS lags
more: the default Corefile serves the `kubernetes` plugin's records with `ttl 30` and caches
them (`cache 30`; Kubernetes docs, "Customizing DNS Service").
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from tardigrade_local.gke.client import ApiClient, Informer, core_path
from tardigrade_local.kubelet import network

COALESCE_SECONDS = 0.2
REFRESH_SECONDS = 1.0


class ClusterDns:
    def __init__(self, client: ApiClient, hosts_file: Path) -> None:
        self.client = client
        self.hosts_file = hosts_file
        self._dirty = asyncio.Event()
        self.pods = Informer(client, core_path("pods"), self._changed)
        self.services = Informer(client, core_path("services"), self._changed)
        self._tasks: list[asyncio.Task[Any]] = []

    def _changed(self, kind: str, obj: dict[str, Any]) -> None:
        self._dirty.set()

    async def start(self) -> None:
        self.write()
        self._tasks = [asyncio.create_task(i.run()) for i in (self.pods, self.services)]
        await asyncio.gather(self.pods.synced.wait(), self.services.synced.wait())
        self.write()
        self._tasks.append(asyncio.create_task(self._loop()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.client.close()

    async def _loop(self) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(COALESCE_SECONDS)
            self._dirty.clear()
            self.write()
            await asyncio.sleep(REFRESH_SECONDS)

    def write(self) -> None:
        text = network.hosts_file(self.pods.cache.values(), self.services.cache.values())
        with contextlib.suppress(OSError):
            if self.hosts_file.read_text() == text:
                return
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.hosts_file)  # readers never see a half-written file
