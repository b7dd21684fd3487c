"""Ports handed to servers that bind them later stay out of the kernel's ephemeral range."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest
from tardigrade_local import ports


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
