"""Projected service-account token volumes, as a kubelet mounts and refreshes them.

Upstream: `pkg/volume/projected/projected.go` (`collectData`): for each `serviceAccountToken`
source the kubelet sends a TokenRequest for the pod's ServiceAccount with the source's
`audience` (empty: the API server's own audiences), `expirationSeconds` (default 3600) and a
`boundObjectRef` to the pod, and writes the token at `path` inside the volume.
`pkg/kubelet/token/token_manager.go` (`requiresRefresh`) fetches a new one once the token is
older than 80% of its lifetime or older than 24 hours, and the volume is rewritten in place,
so a process that rereads the file keeps a valid token however long the pod runs.

Pod processes share this machine's filesystem (see credentials.py), so a volume cannot appear
at its `mountPath`: it is written into the pod's directory, and the container's environment
and arguments that name a path under the mount point are pointed there, as the termination
log path is (launch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tardigrade_local.kubelet.client import ApiClient, ApiError, core_path
from tardigrade_local.kubelet.credentials import service_account_name
from tardigrade_local.kubelet.env import EnvError

DEFAULT_EXPIRATION_SECONDS = 3600
MAX_TOKEN_AGE_SECONDS = 24 * 3600
REFRESH_FRACTION = 0.8


@dataclasses.dataclass(frozen=True)
class TokenFile:
    volume: str
    path: str  # inside the volume
    audience: str | None
    expiration_seconds: int


def token_files(pod_spec: Mapping[str, Any]) -> list[TokenFile]:
    out = []
    for volume in pod_spec.get("volumes") or []:
        for source in (volume.get("projected") or {}).get("sources") or []:
            token = source.get("serviceAccountToken")
            if token is not None:
                out.append(TokenFile(volume["name"], token["path"], token.get("audience"),
                                     int(token.get("expirationSeconds")
                                         or DEFAULT_EXPIRATION_SECONDS)))
    return out


def requires_refresh(issued: float, expires: float, now: float) -> bool:
    """token_manager.go `requiresRefresh` (without its jitter): 80% of the life, or 24 h."""
    ttl = expires - issued
    return now >= expires or now >= issued + REFRESH_FRACTION * ttl or \
        now >= issued + MAX_TOKEN_AGE_SECONDS


def volume_dir(pod_dir: Path, volume: str) -> Path:
    return pod_dir / "volumes" / volume


class ProjectedTokens:
    """Writes a pod's projected tokens, then keeps them fresh until `stop`."""

    def __init__(self, client: ApiClient, pod: Mapping[str, Any], pod_dir: Path) -> None:
        self.client = client
        self.pod = pod
        self.pod_dir = pod_dir
        self.files = token_files(pod["spec"])
        self._lifetimes: dict[TokenFile, tuple[float, float]] = {}
        self._task: asyncio.Task[None] | None = None

    async def write_all(self) -> None:
        for token_file in self.files:
            await self._write(token_file)
        if self.files and self._task is None:
            self._task = asyncio.create_task(self._refresh_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _write(self, token_file: TokenFile) -> None:
        meta = self.pod["metadata"]
        namespace = meta.get("namespace") or "default"
        spec: dict[str, Any] = {
            "expirationSeconds": token_file.expiration_seconds,
            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"],
                               "uid": meta.get("uid", "")}}
        if token_file.audience:
            spec["audiences"] = [token_file.audience]
        path = core_path("serviceaccounts", namespace, service_account_name(self.pod["spec"]),
                         "token")
        try:
            answer = await self.client.create(path, {
                "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
        except ApiError as err:
            raise EnvError(f"failed to fetch token for volume {token_file.volume}: {err}") \
                from err
        target = volume_dir(self.pod_dir, token_file.volume) / token_file.path
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(answer["status"]["token"])
        tmp.chmod(0o600)
        tmp.replace(target)  # atomically, as the kubelet's AtomicWriter swaps the data dir
        now = time.time()
        self._lifetimes[token_file] = (now, now + token_file.expiration_seconds)

    async def _refresh_forever(self) -> None:
        while True:
            now = time.time()
            due = [f for f, (issued, expires) in self._lifetimes.items()
                   if requires_refresh(issued, expires, now)]
            for token_file in due:
                with contextlib.suppress(EnvError):  # kept, and retried on the next pass
                    await self._write(token_file)
            await asyncio.sleep(10)
