"""The kubelet's log endpoint: `GET /containerLogs/{namespace}/{pod}/{container}`.

The API server proxies `pods/{name}/log` here (to the node's InternalIP and
`status.daemonEndpoints.kubeletEndpoint.Port`), as the real one does. Query parameters:
`follow`, `previous`, `tailLines`, `limitBytes`, `timestamps`, `sinceSeconds`, `sinceTime`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from tardigrade_local import crilog
from tardigrade_local.kubelet.podstatus import ContainerRecord
from tardigrade_local.paths import StateLayout

FOLLOW_POLL_SECONDS = 0.2

# (namespace, pod, container) -> the container's record while a worker runs it, else None.
RecordLookup = Callable[[str, str, str], ContainerRecord | None]


def _since(query: dict[str, str]) -> dt.datetime | None:
    if "sinceSeconds" in query:
        return dt.datetime.now(dt.UTC) - dt.timedelta(seconds=int(query["sinceSeconds"]))
    if "sinceTime" in query:
        return dt.datetime.fromisoformat(query["sinceTime"].replace("Z", "+00:00"))
    return None


def log_app(layout: StateLayout, lookup: RecordLookup) -> web.Application:
    async def container_logs(request: web.Request) -> web.StreamResponse:
        ns, pod, container = (request.match_info[k] for k in ("namespace", "pod", "container"))
        q = dict(request.query)
        previous = q.get("previous") in ("true", "1")
        follow = q.get("follow") in ("true", "1") and not previous
        timestamps = q.get("timestamps") in ("true", "1")
        record = lookup(ns, pod, container)
        path: Path = (layout.previous_container_log if previous else layout.container_log)(
            ns, pod, container)
        if not path.exists():
            if previous:
                raise web.HTTPBadRequest(
                    text=f'previous terminated container "{container}" in pod "{pod}" not found')
            reason = (record.state.get("waiting") or {}).get("reason") if record else None
            raise web.HTTPBadRequest(text=f'container "{container}" in pod "{pod}" is waiting '
                                          f"to start: {reason or 'ContainerCreating'}")
        try:
            since = _since(q)
            tail = int(q["tailLines"]) if "tailLines" in q else None
            limit = int(q["limitBytes"]) if "limitBytes" in q else None
        except ValueError as err:
            raise web.HTTPBadRequest(text=str(err)) from None
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        sent = 0

        async def send(records: list[crilog.Record]) -> bool:
            """Write records; False once limitBytes is reached."""
            nonlocal sent
            data = b"".join(r.render(timestamps) for r in records)
            if limit is not None:
                data = data[: max(0, limit - sent)]
            sent += len(data)
            if data:
                await response.write(data)
            return limit is None or sent < limit

        with path.open("rb") as handle:
            data = handle.read()
            # Only complete records: a line still being written is picked up by follow.
            consumed = data.rfind(b"\n") + 1
            handle.seek(consumed)
            more = await send(crilog.select(crilog.parse(data[:consumed]), since, tail))
            pending = b""
            exited = False
            while follow and more:
                chunk = handle.read(64 * 1024)
                if chunk:
                    pending += chunk
                    cut = pending.rfind(b"\n") + 1
                    more = await send(crilog.select(crilog.parse(pending[:cut]), since))
                    pending = pending[cut:]
                    continue
                if exited:
                    break
                current = lookup(ns, pod, container)
                # Once the container has exited its log is complete: one last read, then done.
                exited = current is None or not current.running
                if not exited:
                    await asyncio.sleep(FOLLOW_POLL_SECONDS)
        return response

    app = web.Application()
    app.add_routes([web.get("/containerLogs/{namespace}/{pod}/{container}", container_logs)])
    return app
