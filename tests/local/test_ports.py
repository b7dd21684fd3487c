"""Ports handed to servers that bind them later stay out of the kernel's ephemeral range, and
a control-plane component whose port another process took between its pick and its bind
starts again on another."""

from __future__ import annotations

import asyncio
import random
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from tardigrade_local import controlplane, ports


def test_the_port_is_outside_the_ephemeral_range_and_binds() -> None:
    low, high = ports.ephemeral_range()
    for _ in range(50):
        port = ports.free_port()
        assert not low <= port <= high
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_skipped() -> None:
    first = ports.free_port(random.Random(7))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", first))
        busy.listen()
        assert ports.free_port(random.Random(7)) != first


def test_an_unreadable_range_falls_back_to_linux_default(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "missing")
    assert ports.ephemeral_range() == (32768, 60999)
    assert not 32768 <= ports.free_port() <= 60999


def test_a_range_spanning_every_candidate_leaves_the_choice_to_the_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    assert 1024 <= ports.free_port() <= 65535


class _TakenFirst:
    """`free_port` for the control plane whose `nth` pick is `taken` (a port another process
    bound between the pick and the component's bind), the others real free ports."""

    def __init__(self, nth: int, taken: int) -> None:
        self.nth, self.taken, self.calls = nth, taken, 0

    def __call__(self) -> int:
        self.calls += 1
        return self.taken if self.calls == self.nth else ports.free_port()


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports.free_port()))
        busy.listen()
        yield int(busy.getsockname()[1])


def test_etcd_whose_port_was_taken_meanwhile_starts_on_another(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, taken_port: int) -> None:
    monkeypatch.setattr(controlplane, "free_port", _TakenFirst(1, taken_port))
    plane = controlplane.ControlPlane(tmp_path)

    async def start_etcd() -> None:
        plane._new_etcd_port()
        try:
            await plane._start_on_free_ports("etcd", plane._etcd_argv, plane._etcd_healthy,
                                             plane._new_etcd_port)
            assert await plane._etcd_healthy()
        finally:
            await plane.stop()

    asyncio.run(start_etcd())
    assert plane.etcd_port != taken_port
    log = (tmp_path / "logs" / "etcd.log").read_text()
    assert f"127.0.0.1:{taken_port}: {controlplane.ADDRESS_IN_USE}" in log


def test_a_component_failing_otherwise_is_not_retried(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plane = controlplane.ControlPlane(tmp_path)
    picks: list[int] = []

    async def never() -> bool:
        return False

    async def start() -> None:
        await plane._start_on_free_ports(
            "broken", lambda: [sys.executable, "-c", "raise SystemExit('bad flag')"], never,
            lambda: picks.append(1))

    with pytest.raises(controlplane.ComponentError, match="bad flag"):
        asyncio.run(start())
    assert picks == []


@pytest.mark.slow
def test_kube_apiserver_whose_port_was_taken_meanwhile_starts_on_another(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, taken_port: int) -> None:
    # The second pick of `start` is the API server's port.
    monkeypatch.setattr(controlplane, "free_port", _TakenFirst(2, taken_port))
    plane = controlplane.ControlPlane(tmp_path)

    async def start() -> None:
        async with plane:
            assert await plane._api_ready()

    asyncio.run(start())
    assert plane.api_port != taken_port
    log = (tmp_path / "logs" / "kube-apiserver.log").read_text()
    assert f"127.0.0.1:{taken_port}: {controlplane.ADDRESS_IN_USE}" in log
    # The clients' kubeconfigs were written anew with the port it listens on.
    server = yaml.safe_load(plane.admin_kubeconfig.read_text())["clusters"][0]["cluster"]
    assert server["server"] == plane.api_url
