"""A TCP proxy in front of kube-apiserver, for cutting clients' connections at will.

kube-apiserver has no switch that drops its open watches; a network between a client and it
does (a load balancer's idle timeout, a NAT table flushed, a proxy restarted). This proxy is
that network: it forwards bytes both ways without looking into TLS, and `cut()` closes every
connection it carries, watches and requests alike, as a broken network would. Clients that
must see such cuts (the operator in fault tests) are given the proxy's address; the node
agents and pods talk to the API server directly.
"""

from __future__ import annotations

import asyncio
import contextlib

from tardigrade_local.ports import free_port

BUFFER_BYTES = 256 * 1024


class ApiProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.upstream_port = upstream_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    async def start(self) -> None:
        self.port = free_port()
        self._server = await asyncio.start_server(self._serve, self.host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self.cut()
            await self._server.wait_closed()

    def cut(self) -> int:
        """Close every connection now; returns how many client connections there were."""
        writers, self._writers = set(self._writers), set()
        for writer in writers:
            transport = writer.transport
            if transport is not None:
                transport.abort()
        return len(writers) // 2

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self._writers.difference_update((writer, up_writer))
            for w in (writer, up_writer):
                w.transport.abort()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError, asyncio.IncompleteReadError):
            while data := await reader.read(BUFFER_BYTES):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            writer.write_eof()
