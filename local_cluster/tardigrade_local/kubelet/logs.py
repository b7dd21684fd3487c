"""The kubelet's log endpoint: `GET /containerLogs/{namespace}/{pod}/{container}`.

The API server proxies `pods/{name}/log` here (to the node's InternalIP and
`status.daemonEndpoints.kubeletEndpoint.Port`), as the real one does. Supported query
parameters: `follow`, `previous`, `tailLines`, `limitBytes`. Logs are stored without
timestamps, so `timestamps` and `sinceSeconds` are accepted and ignored.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from tardigrade_local.kubelet.podstatus import ContainerRecord
from tardigrade_local.paths import StateLayout

FOLLOW_POLL_SECONDS = 0.2
CHUNK = 64 * 1024

# (namespace, pod, container) -> the container's record while a worker runs it, else None.
RecordLookup = Callable[[str, str, str], ContainerRecord | None]


def _tail(data: bytes, lines: int) -> bytes:
    if lines <= 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


def log_app(layout: StateLayout, lookup: RecordLookup) -> web.Application:
    async def container_logs(request: web.Request) -> web.StreamResponse:
        ns, pod, container = (request.match_info[k] for k in ("namespace", "pod", "container"))
        q = request.query
        previous = q.get("previous") in ("true", "1")
        follow = q.get("follow") in ("true", "1") and not previous
        record = lookup(ns, pod, container)
        path: Path = (layout.previous_container_log if previous else layout.container_log)(
            ns, pod, container)
        if not path.exists():
            if previous:
                raise web.HTTPBadRequest(
                    text=f'previous terminated container "{container}" in pod "{pod}" not found')
            reason = ((record.state.get("waiting") or {}).get("reason") if record else None)
            raise web.HTTPBadRequest(text=f'container "{container}" in pod "{pod}" is waiting '
                                          f"to start: {reason or 'ContainerCreating'}")
        data = path.read_bytes()
        if "tailLines" in q:
            data = _tail(data, int(q["tailLines"]))
        limit = int(q["limitBytes"]) if "limitBytes" in q else None
        if limit is not None:
            data = data[:limit]
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(data)
        if not follow or (limit is not None and len(data) >= limit):
            return response
        sent = len(data) if limit is not None else None
        offset = path.stat().st_size
        with path.open("rb") as handle:
            handle.seek(offset)
            while True:
                chunk = handle.read(CHUNK)
                if chunk:
                    if sent is not None and limit is not None:
                        chunk = chunk[: limit - sent]
                        sent += len(chunk)
                    await response.write(chunk)
                    if sent is not None and limit is not None and sent >= limit:
                        break
                    continue
                current = lookup(ns, pod, container)
                if current is None or not current.running:
                    break
                await asyncio.sleep(FOLLOW_POLL_SECONDS)
        return response

    app = web.Application()
    app.add_routes([web.get("/containerLogs/{namespace}/{pod}/{container}", container_logs)])
    return app
