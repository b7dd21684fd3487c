"""Startup, liveness and readiness probes (httpGet, tcpSocket, exec) of one container.

Semantics follow the kubelet: readiness and liveness wait for the startup probe; a container
with a readiness probe is not ready until it succeeds; `failureThreshold` consecutive
liveness or startup failures kill the container (the restart policy decides what follows).
gRPC probes are not run here and count as successful.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp


@dataclasses.dataclass(frozen=True)
class ProbeTarget:
    """Where the container listens and how to run commands in it."""

    ip: str
    ports: Mapping[str, int]  # named container ports
    env: Mapping[str, str]
    cwd: Path


def _port(value: Any, target: ProbeTarget) -> int:
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    return target.ports[str(value)]


async def probe_once(probe: Mapping[str, Any], target: ProbeTarget) -> bool:
    timeout = float(probe.get("timeoutSeconds") or 1)
    try:
        if "httpGet" in probe:
            action = probe["httpGet"]
            host = action.get("host") or target.ip
            scheme = str(action.get("scheme") or "HTTP").lower()
            url = f"{scheme}://{host}:{_port(action['port'], target)}{action.get('path') or '/'}"
            headers = {h["name"]: h["value"] for h in action.get("httpHeaders") or []}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s, \
                    s.get(url, headers=headers, allow_redirects=False) as resp:
                return 200 <= resp.status < 400
        if "tcpSocket" in probe:
            action = probe["tcpSocket"]
            host = action.get("host") or target.ip
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host, _port(action["port"], target)), timeout)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return True
        if "exec" in probe:
            proc = await asyncio.create_subprocess_exec(
                *probe["exec"]["command"], env=dict(target.env), cwd=target.cwd,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            try:
                return await asyncio.wait_for(proc.wait(), timeout) == 0
            except TimeoutError:
                proc.kill()
                await proc.wait()
                return False
    except (OSError, TimeoutError, aiohttp.ClientError, KeyError, ValueError):
        return False
    return True  # grpc and anything unknown


class ContainerProbes:
    """Runs a container's probes until cancelled; reports through callbacks."""

    def __init__(self, spec: Mapping[str, Any], target: ProbeTarget,
                 on_change: Callable[[], Awaitable[None]],
                 on_fatal: Callable[[str, str], Awaitable[None]]) -> None:
        self.startup = spec.get("startupProbe")
        self.liveness = spec.get("livenessProbe")
        self.readiness = spec.get("readinessProbe")
        self.target = target
        self.on_change = on_change
        self.on_fatal = on_fatal  # (probe kind, message): the container must be killed
        self.started = self.startup is None
        self.ready = self.readiness is None
        self._started_event = asyncio.Event()
        if self.started:
            self._started_event.set()

    @property
    def active(self) -> bool:
        return any((self.startup, self.liveness, self.readiness))

    async def run(self) -> None:
        loops = []
        if self.startup:
            loops.append(self._loop("Startup", self.startup))
        if self.liveness:
            loops.append(self._after_start(self._loop("Liveness", self.liveness)))
        if self.readiness:
            loops.append(self._after_start(self._loop("Readiness", self.readiness)))
        await asyncio.gather(*loops)

    async def _after_start(self, coro: Awaitable[None]) -> None:
        await self._started_event.wait()
        await coro

    async def _loop(self, kind: str, probe: Mapping[str, Any]) -> None:
        period = float(probe.get("periodSeconds") or 10)
        failures_allowed = int(probe.get("failureThreshold") or 3)
        successes_needed = int(probe.get("successThreshold") or 1)
        await asyncio.sleep(float(probe.get("initialDelaySeconds") or 0))
        failures = successes = 0
        while True:
            ok = await probe_once(probe, self.target)
            failures, successes = (0, successes + 1) if ok else (failures + 1, 0)
            if kind == "Startup" and ok:
                self.started = True
                self._started_event.set()
                await self.on_change()
                return
            if kind == "Readiness":
                recovered = self.ready or successes >= successes_needed
                ready = recovered and failures < failures_allowed
                if ready != self.ready:
                    self.ready = ready
                    await self.on_change()
            elif failures >= failures_allowed:
                await self.on_fatal(kind, f"Container failed {kind.lower()} probe, will be "
                                          "restarted")
                return
            await asyncio.sleep(period)
