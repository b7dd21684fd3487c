"""Loaded by every Python process the local kubelet starts (its directory is on PYTHONPATH).

Pods share the machine's network, so this gives each one what a pod network would:
- names from the kubelet's hosts file (headless-service pod names) resolve to pod IPs through
  `socket.getaddrinfo` / `gethostbyname`, the functions Python clients and servers use;
- a listening socket bound to the wildcard address binds the pod's own IP instead, so two
  pods can listen on the same port;
- `socket.gethostname()` is the pod's hostname.
Programs outside Python (e.g. a C++ gRPC client) do not see this: resolve the name in Python
first and hand them the address.
Nothing here runs unless the kubelet set TARDIGRADE_HOSTS_FILE.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import socket
import sys
from typing import Any

_HOSTS_FILE = os.environ.get("TARDIGRADE_HOSTS_FILE")
_POD_IP = os.environ.get("TARDIGRADE_POD_IP")
_HOSTNAME = os.environ.get("HOSTNAME")
_cache: dict[str, Any] = {"mtime": None, "table": {}}


def _table() -> dict[str, str]:
    try:
        mtime = os.stat(_HOSTS_FILE or "").st_mtime_ns
    except OSError:
        return {}
    if mtime != _cache["mtime"]:
        table: dict[str, str] = {}
        with open(_HOSTS_FILE or "", encoding="utf-8") as handle:
            for line in handle:
                fields = line.split("#", 1)[0].split()
                for name in fields[1:]:
                    table.setdefault(name.lower(), fields[0])
        _cache.update(mtime=mtime, table=table)
    return _cache["table"]


def _lookup(host: Any) -> Any:
    if isinstance(host, bytes):
        found = _lookup(host.decode("idna", "replace"))
        return found.encode() if isinstance(found, str) else host
    if isinstance(host, str) and host:
        if _HOSTNAME and host == _HOSTNAME and _POD_IP:
            return _POD_IP
        return _table().get(host.rstrip(".").lower(), host)
    return host


def _install() -> None:
    getaddrinfo, gethostbyname, gethostbyname_ex = (
        socket.getaddrinfo, socket.gethostbyname, socket.gethostbyname_ex
    )
    bind = socket.socket.bind

    def patched_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        return getaddrinfo(_lookup(host), *args, **kwargs)

    def patched_gethostbyname(host: str) -> str:
        return gethostbyname(_lookup(host))

    def patched_gethostbyname_ex(host: str) -> Any:
        return gethostbyname_ex(_lookup(host))

    def patched_bind(self: socket.socket, address: Any) -> None:
        if (
            _POD_IP
            and self.family == socket.AF_INET
            and isinstance(address, tuple)
            and address[0] in ("", "0.0.0.0")
        ):
            address = (_POD_IP, *address[1:])
        bind(self, address)

    socket.getaddrinfo = patched_getaddrinfo
    socket.gethostbyname = patched_gethostbyname
    socket.gethostbyname_ex = patched_gethostbyname_ex
    socket.socket.bind = patched_bind  # type: ignore[method-assign]
    if _HOSTNAME:
        socket.gethostname = lambda: _HOSTNAME


def _chain() -> None:
    """Run the sitecustomize this one shadows, if the interpreter has one."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if _HOSTS_FILE:
    _install()
_chain()
