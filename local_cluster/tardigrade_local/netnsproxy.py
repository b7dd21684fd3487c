"""A TCP port inside a node's network namespace that leads to an address of this host's.

A real node's kubelet runs in a network namespace of its own (`realnode.py`), whose loopback
is not the host's: kube-apiserver listens on the host's 127.0.0.1 only. This process opens a
listening socket inside the node's namespace (setns(2) into it, bind, setns back) and relays
each connection to the host address, so the kubelet reaches the API server at
`https://127.0.0.1:PORT` inside its namespace, where the API server's serving certificate
names 127.0.0.1. No address or route is added to the host for it.

`python -m tardigrade_local.netnsproxy NETNS_PATH [ADDRESS:]PORT TARGET_HOST:TARGET_PORT`
(ADDRESS: one of the namespace's, 127.0.0.1 if not given)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tardigrade_local import lifetime
from tardigrade_local.lifetime import die_with_parent

CLONE_NEWNET = 0x40000000
STOP_TIMEOUT_SECONDS = 10.0
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def socket_in(netns_path: str) -> socket.socket:
    """A non-blocking TCP socket of the namespace at `netns_path`: what it binds or connects
    to is that namespace's. The calling thread is back in its own namespace on return."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(netns_path, os.O_RDONLY)
    try:
        _setns(target)
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        finally:
            _setns(own)
    finally:
        os.close(own)
        os.close(target)
    sock.setblocking(False)
    return sock


def listen_in(netns_path: str, port: int, address: str = "127.0.0.1") -> socket.socket:
    """A listening socket on `address`:`port` of the namespace at `netns_path`."""
    sock = socket_in(netns_path)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(128)
    return sock


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


async def serve(sock: socket.socket, host: str, port: int) -> None:
    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(relay, sock=sock)
    async with server:
        await server.serve_forever()


class RelayError(RuntimeError):
    pass


def spawn(netns_path: Path, listen: str, target: str, log_path: Path
          ) -> subprocess.Popen[str]:
    """Run this module as a child (it dies with the calling thread's process) relaying
    `listen` ([ADDRESS:]PORT in the namespace) to `target` (HOST:PORT of this host's);
    returned once it listens. Its stderr goes to `log_path`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "a") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tardigrade_local.netnsproxy", str(netns_path), listen,
             target],
            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=env, text=True,
            preexec_fn=die_with_parent)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "listening":
        stop(proc)
        raise RelayError(f"the relay to {target} did not start: "
                         f"{log_path.read_text(errors='replace')[-3000:]}")
    return proc


def stop(proc: subprocess.Popen[str] | None) -> None:
    """Stop a relay `spawn` started (SIGTERM, SIGKILL after a while) and reap it. Idempotent."""
    if proc is None:
        return
    lifetime.stop(proc, STOP_TIMEOUT_SECONDS)
    if proc.stdout is not None:
        proc.stdout.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    netns_path, listen, target = args
    address, _, port = listen.rpartition(":")
    host, _, target_port = target.rpartition(":")
    sock = listen_in(netns_path, int(port), address or "127.0.0.1")
    print("listening", flush=True)
    asyncio.run(serve(sock, host, int(target_port)))


if __name__ == "__main__":
    main()
