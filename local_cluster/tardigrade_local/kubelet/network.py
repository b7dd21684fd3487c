"""Pod addresses and names on a shared loopback.

Every pod gets its own 127.x.y.z address (Linux routes all of 127/8 to the loopback device),
so two pods can listen on the same port. There is no cluster DNS: the kubelet keeps an
/etc/hosts-format file with the names a headless Service gives its pods
(`<hostname>.<subdomain>.<ns>.svc.cluster.local` and shorter forms), and pods resolve through
it (see `podsite/sitecustomize.py`).
"""

from __future__ import annotations

import functools
import ipaddress
import random
import socket
from collections.abc import Iterable, Mapping
from typing import Any

CLUSTER_DOMAIN = "cluster.local"
POD_NETWORK = ipaddress.ip_network("127.16.0.0/12")
NODE_NETWORK = ipaddress.ip_network("127.8.0.0/16")


@functools.cache
def loopback_aliases_work() -> bool:
    """Linux routes all of 127/8 to loopback; macOS has only 127.0.0.1 unless aliased."""
    try:
        with socket.socket() as sock:
            sock.bind(("127.8.0.1", 0))
        return True
    except OSError:
        return False


class IpAllocator:
    """Hands out pod IPs round-robin, so a fresh pod rarely reuses a just-released address.

    Where only 127.0.0.1 exists, every pod gets it (pods then share one port space).
    """

    def __init__(self, network: ipaddress.IPv4Network = POD_NETWORK) -> None:
        self._shared = not loopback_aliases_work()
        self._network = network
        # A random start keeps two clusters on one machine (e.g. parallel test runs) apart.
        self._next = random.randrange(1, network.num_addresses - 1)
        self._used: set[str] = set()

    def allocate(self) -> str:
        if self._shared:
            return "127.0.0.1"
        size = self._network.num_addresses
        for _ in range(size):
            candidate = self._network[self._next]
            self._next = self._next + 1 if self._next + 2 < size else 1
            text = str(candidate)
            if text.endswith((".0", ".255")) or text in self._used:
                continue
            self._used.add(text)
            return text
        raise RuntimeError("pod address range exhausted")

    def release(self, ip: str | None) -> None:
        self._used.discard(ip or "")


def node_ip(index: int) -> str:
    return str(NODE_NETWORK[index + 1]) if loopback_aliases_work() else "127.0.0.1"


def _selects(selector: Mapping[str, str] | None, labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def pod_dns_names(pod: Mapping[str, Any], services: Iterable[Mapping[str, Any]]) -> list[str]:
    """Names a pod gets from a headless Service named like its `subdomain`."""
    meta, spec = pod["metadata"], pod["spec"]
    hostname, subdomain = spec.get("hostname"), spec.get("subdomain")
    if not hostname or not subdomain:
        return []
    namespace = meta.get("namespace") or "default"
    for svc in services:
        svc_meta = svc["metadata"]
        svc_spec = svc.get("spec") or {}
        if (
            svc_meta["name"] == subdomain
            and (svc_meta.get("namespace") or "default") == namespace
            and svc_spec.get("clusterIP") == "None"
            and _selects(svc_spec.get("selector"), meta.get("labels") or {})
        ):
            base = f"{hostname}.{subdomain}"
            return [
                f"{base}.{namespace}.svc.{CLUSTER_DOMAIN}",
                f"{base}.{namespace}.svc",
                f"{base}.{namespace}",
                base,
            ]
    return []


def hosts_file(pods: Iterable[Mapping[str, Any]], services: Iterable[Mapping[str, Any]]) -> str:
    """/etc/hosts text for every running pod that has headless-service names."""
    # Each pod can only match the Services named like its subdomain: look those up, rather
    # than scanning every Service for every pod (a million checks at 1,000 one-pod jobs).
    by_name: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for svc in services:
        svc_meta = svc["metadata"]
        by_name.setdefault((svc_meta.get("namespace") or "default", svc_meta["name"]),
                           []).append(svc)
    lines = ["# Written by the tardigrade local kubelet: headless-service pod names."]
    def key(pod: Mapping[str, Any]) -> tuple[str, str]:
        return pod["metadata"].get("namespace", ""), pod["metadata"]["name"]

    for pod in sorted(pods, key=key):
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or pod["metadata"].get("deletionTimestamp"):
            continue
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        meta = pod["metadata"]
        subdomain = (pod.get("spec") or {}).get("subdomain")
        names = pod_dns_names(pod, by_name.get((meta.get("namespace") or "default",
                                                 str(subdomain)), []))
        if names:
            lines.append(f"{ip} {' '.join(names)}")
    return "\n".join(lines) + "\n"
