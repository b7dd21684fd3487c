"""kube-apiserver's way to the real nodes: an HTTP CONNECT proxy on a Unix socket.

A real node's kubelet listens on the node's address inside the node's own network namespace
(`realnode.py`), which the host cannot route to. kube-apiserver's egress selector
(`--egress-selector-config-file`, egress `cluster`, `proxyProtocol: HTTPConnect` over
`uds`; Kubernetes docs "Set up Konnectivity service") sends every connection it opens
towards the cluster (kubelets for logs, exec and port-forward; webhooks) through a proxy
instead of dialing: GKE's control plane reaches its nodes the same way, through Konnectivity.

This proxy answers `CONNECT host:port`:
- a node address with a route file (`ROUTES_DIR/<address>`, holding the path of the node's
  network namespace, written by `RealNode`): connected from inside that namespace;
- a loopback address (webhooks, simulated nodes' kubelet endpoints): connected directly;
- anything else: 502. The local cluster reaches nothing outside this machine.

`python -m tardigrade_local.egressproxy SOCKET ROUTES_DIR`
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from tardigrade_local.netnsproxy import pipe, socket_in

CONNECT_TIMEOUT_SECONDS = 10.0


def egress_config(socket_path: Path) -> str:
    """The `--egress-selector-config-file` that sends egress `cluster` through us."""
    return f"""\
apiVersion: apiserver.k8s.io/v1beta1
kind: EgressSelectorConfiguration
egressSelections:
- name: cluster
  connection:
    proxyProtocol: HTTPConnect
    transport:
      uds:
        udsName: {socket_path}
"""


class Refused(Exception):
    pass


def _target(authority: str) -> tuple[str, int]:
    host, sep, port = authority.rpartition(":")
    if not sep or not port.isdigit():
        raise Refused(f"not host:port: {authority!r}")
    return host.strip("[]"), int(port)


async def _connect(routes: Path, host: str, port: int) -> tuple[asyncio.StreamReader,
                                                                asyncio.StreamWriter]:
    try:
        address = ipaddress.ip_address("127.0.0.1" if host == "localhost" else host)
    except ValueError as err:
        raise Refused(f"not an address: {host!r}") from err
    route = routes / str(address)
    if route.is_file():
        sock = socket_in(route.read_text().strip())
    elif address.is_loopback:
        sock = socket.socket(socket.AF_INET6 if address.version == 6 else socket.AF_INET,
                             socket.SOCK_STREAM)
        sock.setblocking(False)
    else:
        raise Refused(f"{address} is neither loopback nor a real node's address")
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(loop.sock_connect(sock, (str(address), port)),
                               CONNECT_TIMEOUT_SECONDS)
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


def handler(routes: Path) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                      Awaitable[None]]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await reader.readuntil(b"\r\n\r\n")
            method, authority, _ = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            if method != "CONNECT":
                raise Refused(f"method {method}")
            up_reader, up_writer = await _connect(routes, *_target(authority))
        except (Refused, OSError, TimeoutError, ValueError, asyncio.IncompleteReadError,
                asyncio.LimitOverrunError) as err:
            with contextlib.suppress(OSError):
                writer.write(f"HTTP/1.1 502 Bad Gateway\r\n\r\n{err}".encode())
                await writer.drain()
                writer.close()
            return
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    return handle


async def serve(socket_path: Path, routes: Path) -> None:
    routes.mkdir(parents=True, exist_ok=True)
    socket_path.unlink(missing_ok=True)
    server = await asyncio.start_unix_server(handler(routes), path=str(socket_path))
    os.chmod(socket_path, 0o600)  # kube-apiserver runs as the same user
    async with server:
        await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        sys.exit(__doc__.strip().splitlines()[-1])
    asyncio.run(serve(Path(args[0]), Path(args[1])))


if __name__ == "__main__":
    main()
