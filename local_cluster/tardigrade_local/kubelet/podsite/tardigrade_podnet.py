"""Pod networking for Python processes on the shared loopback (standard library only).

The kubelet keeps an /etc/hosts-format file of headless-service pod names (`paths.hosts_file`).
`install()` makes `socket.getaddrinfo` / `gethostbyname` consult it, and, inside a pod,
rebinds wildcard IPv4 listeners to the pod's own IP and reports the pod's hostname. Pods get
this automatically (`sitecustomize.py` beside this file); a process outside the cluster that
must reach pods by name, such as an operator run from a test, calls `install(hosts_file)`
(through `tardigrade_local.podnet`, the same module object).
This file lives in the site directory the kubelet puts on every pod's PYTHONPATH and imports
nothing but the standard library: the pod network is the container runtime's job, not the
image's, so it must work in a shipped image's venv, which has no `tardigrade_local`.
Non-Python resolvers (e.g. C++ gRPC inside JAX) do not see it: resolve in Python first.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

ENV_HOSTS_FILE = "TARDIGRADE_HOSTS_FILE"
ENV_POD_IP = "TARDIGRADE_POD_IP"
ENV_POD_NAMES = "TARDIGRADE_POD_NAMES"

_lock = threading.Lock()
_state: dict[str, Any] = {"installed": False, "file": None, "mtime": None, "table": {},
                          "pod_ip": None, "hostname": None, "own_names": frozenset()}


def _table() -> dict[str, str]:
    path = _state["file"]
    try:
        info = os.stat(path)
        # Not the mtime alone: two rewrites within one timestamp tick would leave the table
        # stale; the kubelet replaces the file, so the inode changes on every rewrite.
        mtime = (info.st_mtime_ns, info.st_ino, info.st_size)
    except (OSError, TypeError):
        return {}
    with _lock:
        if mtime != _state["mtime"]:
            table: dict[str, str] = {}
            with open(path, encoding="utf-8") as handle:
                for line in handle:
                    fields = line.split("#", 1)[0].split()
                    for name in fields[1:]:
                        table.setdefault(name.lower(), fields[0])
            _state.update(mtime=mtime, table=table)
        return _state["table"]


def lookup(host: Any) -> Any:
    """The address for a cluster name, or `host` unchanged."""
    if isinstance(host, bytes):
        found = lookup(host.decode("idna", "replace"))
        return found.encode() if isinstance(found, str) else host
    if isinstance(host, str) and host:
        if _state["pod_ip"] and (host == _state["hostname"]
                                 or host.rstrip(".").lower() in _state["own_names"]):
            return _state["pod_ip"]
        return _table().get(host.rstrip(".").lower(), host)
    return host


def install(hosts_file: str | os.PathLike[str], pod_ip: str | None = None,
            hostname: str | None = None, own_names: tuple[str, ...] = ()) -> None:
    """Resolve cluster names in this process; with `pod_ip`, behave as that pod, whose own
    names (`own_names`, as its /etc/hosts lists them) resolve to it from the start."""
    _state.update(file=os.fspath(hosts_file), mtime=None, pod_ip=pod_ip, hostname=hostname,
                  own_names=frozenset(n.lower() for n in own_names))
    if _state["installed"]:
        return
    _state["installed"] = True
    getaddrinfo, gethostbyname, gethostbyname_ex = (
        socket.getaddrinfo, socket.gethostbyname, socket.gethostbyname_ex)
    bind = socket.socket.bind
    gethostname = socket.gethostname

    def patched_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        return getaddrinfo(lookup(host), *args, **kwargs)

    def patched_gethostbyname(host: str) -> str:
        return gethostbyname(lookup(host))

    def patched_gethostbyname_ex(host: str) -> Any:
        return gethostbyname_ex(lookup(host))

    def patched_bind(self: socket.socket, address: Any) -> None:
        pod = _state["pod_ip"]
        if (pod and self.family == socket.AF_INET and isinstance(address, tuple)
                and address[0] in ("", "0.0.0.0")):
            address = (pod, *address[1:])
        bind(self, address)

    def patched_gethostname() -> str:
        return _state["hostname"] or gethostname()

    socket.getaddrinfo = patched_getaddrinfo
    socket.gethostbyname = patched_gethostbyname
    socket.gethostbyname_ex = patched_gethostbyname_ex
    socket.socket.bind = patched_bind  # type: ignore[method-assign]
    socket.gethostname = patched_gethostname


def install_from_env() -> bool:
    """What a pod does at start-up; False when the kubelet did not set the variables."""
    hosts_file = os.environ.get(ENV_HOSTS_FILE)
    if not hosts_file:
        return False
    names = tuple(n for n in os.environ.get(ENV_POD_NAMES, "").split(",") if n)
    install(hosts_file, os.environ.get(ENV_POD_IP), os.environ.get("HOSTNAME"), names)
    return True
