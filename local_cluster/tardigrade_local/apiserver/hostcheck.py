"""Refuse requests whose Host header names a host this server is not (DNS rebinding).

Not upstream behaviour: kube-apiserver does not look at Host, because every request on its
secure port must authenticate. This server's plain port does not (see `access.py`), and it
listens on loopback, where a web page can reach it through a name it controls that resolves
to 127.0.0.1 (DNS rebinding); the browser then sends that name as Host. A rebinding attack
needs a DNS name, so an IP literal (the bound address, 127.0.0.1, ::1) is always accepted,
as are `localhost` and the names in the serving certificate (`tls.py`).
"""

from __future__ import annotations

import ipaddress

from .errors import ApiError

LOCAL_NAMES = frozenset({"localhost", "kubernetes.default.svc"})


def hostname(host_header: str) -> str:
    """The host part of a Host header: `[::1]:6443` -> `::1`, `localhost:80` -> `localhost`."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def check_host(host_header: str | None, extra_names: frozenset[str] = frozenset()) -> None:
    """Raise 403 unless the Host header names this server (an HTTP/1.0 request has none)."""
    if not host_header:
        return
    host = hostname(host_header)
    if _is_ip(host) or host in LOCAL_NAMES or host in extra_names:
        return
    raise ApiError(403, "Forbidden",
                   f'host "{host}" is not served here: this local API server answers only to '
                   f"IP addresses, {', '.join(sorted(LOCAL_NAMES | extra_names))} (a DNS name "
                   f"that resolves to loopback is how a web page reaches it: DNS rebinding)")
