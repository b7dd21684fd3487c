"""The logind stand-in of the real nodes (logind.py) on a bus of its own: the kubelet's calls
answered as logind answers them, nothing else, and a shutdown that waits for the delay locks
or for InhibitDelayMaxUSec. A D-Bus client here plays the kubelet's part (the real kubelet's is
in test_real_node_shutdown.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus
from tardigrade_local import nodepower

from tests.polling import wait_for

pytestmark = pytest.mark.skipif(shutil.which("dbus-daemon") is None,
                                 reason="needs Debian's dbus-daemon (scripts/setup installs it)")

LOGIND = {"destination": "org.freedesktop.login1", "path": "/org/freedesktop/login1"}
MANAGER = "org.freedesktop.login1.Manager"
KUBELET_INHIBIT = ["shutdown", "kubelet", "Kubelet needs time to handle node shutdown",
                   "delay"]  # inhibit_linux.go, InhibitShutdown
DELAY_USEC = 2_000_000


class Standin:
    def __init__(self, directory: Path) -> None:
        self.address = f"unix:path={directory / nodepower.BUS_SOCKET}"
        self.control = nodepower.LogindControl(directory / nodepower.CONTROL_SOCKET)


@pytest.fixture
def standin() -> Iterator[Standin]:
    # A short directory: a unix socket's path holds at most 107 bytes.
    directory = Path(tempfile.mkdtemp(prefix="logind-"))
    (directory / "etc").mkdir()
    daemon, logind, env = nodepower.bus_commands(directory, directory, sys.executable,
                                                 delay_usec=DELAY_USEC)
    procs = [subprocess.Popen(daemon, stderr=subprocess.DEVNULL)]
    try:
        wait_for(lambda: (directory / nodepower.BUS_SOCKET).exists(), 30, what="the bus")
        procs.append(subprocess.Popen(logind, env={**os.environ, **env}))
        running = Standin(directory)
        wait_for(lambda: running.control.holders() is not None, 30, what="the stand-in")
        yield running
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(directory, ignore_errors=True)


async def connect(standin: Standin) -> MessageBus:
    return await MessageBus(bus_address=standin.address, negotiate_unix_fd=True).connect()


async def call(bus: MessageBus, interface: str, member: str, signature: str,
               body: list[Any]) -> Message:
    reply = await bus.call(Message(**LOGIND, interface=interface, member=member,
                                   signature=signature, body=body))
    assert reply is not None
    return reply


def test_it_reports_the_inhibit_delay_the_kubelet_reads(standin):
    async def scenario() -> Message:
        bus = await connect(standin)
        try:
            return await call(bus, "org.freedesktop.DBus.Properties", "Get", "ss",
                              [MANAGER, "InhibitDelayMaxUSec"])
        finally:
            bus.disconnect()

    reply = asyncio.run(scenario())
    assert reply.message_type == MessageType.METHOD_RETURN
    assert reply.body[0].signature == "t"  # the kubelet asserts a uint64
    assert reply.body[0].value == DELAY_USEC


def test_it_serves_nothing_but_the_kubelets_calls(standin):
    async def scenario() -> list[Message]:
        bus = await connect(standin)
        try:
            return [
                await call(bus, MANAGER, "ListInhibitors", "", []),
                await call(bus, "org.freedesktop.DBus.Properties", "GetAll", "s", [MANAGER]),
                await call(bus, MANAGER, "PowerOff", "b", [False]),
                await call(bus, MANAGER, "Inhibit", "ssss",
                           ["sleep", "someone", "why", "delay"]),
                await call(bus, MANAGER, "Inhibit", "ssss",
                           ["shutdown", "someone", "why", "block"]),
            ]
        finally:
            bus.disconnect()

    replies = asyncio.run(scenario())
    assert [r.message_type for r in replies] == [MessageType.ERROR] * 5
    assert [r.error_name for r in replies] == [
        "org.freedesktop.DBus.Error.UnknownMethod"] * 3 + [
        "org.freedesktop.DBus.Error.NotSupported"] * 2
    assert standin.control.holders() == []


def test_a_shutdown_waits_for_the_lock_and_goes_on_once_it_is_released(standin):
    async def scenario() -> tuple[dict[str, Any], list[bool], Message]:
        bus = await connect(standin)
        try:
            lock = await call(bus, MANAGER, "Inhibit", "ssss", KUBELET_INHIBIT)
            assert lock.message_type == MessageType.METHOD_RETURN, lock.body
            assert len(lock.unix_fds) == 1
            # MonitorShutdown's match rule (inhibit_linux.go).
            await bus.call(Message(
                destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
                interface="org.freedesktop.DBus", member="AddMatch", signature="s",
                body=[f"type='signal',interface='{MANAGER}',member='PrepareForShutdown',"
                      f"path='/org/freedesktop/login1'"]))
            signals: list[bool] = []
            signalled = asyncio.Event()

            def on_message(msg: Message) -> None:
                if msg.member == "PrepareForShutdown":
                    signals.append(msg.body[0])
                    signalled.set()

            bus.add_message_handler(on_message)
            assert standin.control.holders() == ["kubelet"]
            shutdown = asyncio.get_running_loop().run_in_executor(
                None, standin.control.prepare_for_shutdown, 30.0)
            await asyncio.wait_for(signalled.wait(), 30)
            # As the kubelet's processShutdownEvent does once its pods are gone.
            os.close(lock.unix_fds[0])
            account = await shutdown
            again = await call(bus, MANAGER, "Inhibit", "ssss", KUBELET_INHIBIT)
            return account, signals, again
        finally:
            bus.disconnect()

    account, signals, again = asyncio.run(scenario())
    assert signals == [True]
    assert account["released"] is True
    assert account["holders"] == ["kubelet"] and account["still_held"] == []
    assert account["seconds"] < DELAY_USEC / 1e6
    # logind refuses a new delay lock for a shutdown already under way.
    assert again.error_name == "org.freedesktop.login1.OperationInProgress"


def test_a_lock_kept_past_the_delay_does_not_stop_the_shutdown(standin):
    async def scenario() -> dict[str, Any]:
        bus = await connect(standin)
        try:
            lock = await call(bus, MANAGER, "Inhibit", "ssss", KUBELET_INHIBIT)
            try:
                return await asyncio.get_running_loop().run_in_executor(
                    None, standin.control.prepare_for_shutdown, 30.0)
            finally:
                os.close(lock.unix_fds[0])
        finally:
            bus.disconnect()

    account = asyncio.run(scenario())
    assert account["released"] is False
    assert account["still_held"] == ["kubelet"]
    assert account["seconds"] >= DELAY_USEC / 1e6
