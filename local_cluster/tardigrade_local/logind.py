"""A stand-in for systemd-logind on a real node's own system bus: what the kubelet's graceful
node shutdown calls on logind, and nothing more.

A VM's shutdown reaches the kubelet through logind (the "delay" inhibitor pattern of
https://systemd.io/INHIBITOR_LOCKS/). The kubelet (`pkg/kubelet/nodeshutdown/systemd/
inhibit_linux.go`, driven by `nodeshutdown_manager_linux.go`, k8s.io/kubernetes v1.36.3):
- reads the property `org.freedesktop.login1.Manager.InhibitDelayMaxUSec`
  (`CurrentInhibitDelay`); when it is below the shutdown grace period the kubelet writes
  `/etc/systemd/logind.conf.d/99-kubelet.conf` and asks systemd to SIGHUP logind
  (`OverrideInhibitDelay`, `ReloadLogindConf`). We report the node's grace, as a GKE node's
  logind does once the kubelet's override is in place, so it never does either: no
  `org.freedesktop.systemd1` is served, and nothing is written into the host's /etc;
- calls `Inhibit("shutdown", "kubelet", ..., "delay")` and keeps the file descriptor it gets
  (`InhibitShutdown`);
- subscribes to the signal `PrepareForShutdown` (`MonitorShutdown`, a match rule the bus
  daemon handles); on `true` it marks the node not ready, kills its pods by priority group and
  closes the descriptor (`ReleaseInhibitLock`); on `false` it takes a new lock.

logind itself (systemd `src/login/logind-dbus.c`): on a shutdown request it emits
`PrepareForShutdown(true)` and delays the shutdown until every delay inhibitor is released
(the last write end of its FIFO closed) or `InhibitDelayMaxUSec` has passed since the
request (`delay_shutdown_or_sleep`, `manager_inhibit_timeout_handler`), then shuts down; a new
delay lock for an action already under way is refused (`BUS_ERROR_OPERATION_IN_PROGRESS`).

The stand-in serves exactly that on the bus under `org.freedesktop.login1`; every other call
is answered with `UnknownMethod`. The node (`realnode.RealNode.shutdown`) drives it through a
control socket of its own (JSON lines, `nodepower.LogindControl`), never through the bus.

Why dbus-fast (PyPI): a pure-Python asyncio D-Bus library with no dependencies that passes
unix file descriptors (type `h`), which an inhibitor lock is; the stand-in is a few dozen
lines of Python like the node's other helpers (`netnsproxy`), while a Go one (godbus, the
kubelet's own library) would need a module of our own source in the Go builds.

`python -m tardigrade_local.logind BUS_ADDRESS CONTROL_SOCKET DELAY_USEC`
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.constants import BusType, RequestNameReply

LOGIND_NAME = "org.freedesktop.login1"
LOGIND_PATH = "/org/freedesktop/login1"
MANAGER_INTERFACE = "org.freedesktop.login1.Manager"
PROPERTIES_INTERFACE = "org.freedesktop.DBus.Properties"
ERROR_UNKNOWN_METHOD = "org.freedesktop.DBus.Error.UnknownMethod"
ERROR_NOT_SUPPORTED = "org.freedesktop.DBus.Error.NotSupported"
ERROR_IN_PROGRESS = "org.freedesktop.login1.OperationInProgress"


@dataclasses.dataclass
class Inhibitor:
    what: str
    who: str
    why: str
    mode: str
    read_end: int


class Logind:
    def __init__(self, bus: MessageBus, delay_usec: int) -> None:
        self.bus = bus
        self.delay_usec = delay_usec
        self.inhibitors: list[Inhibitor] = []
        self.shutting_down = False
        self._released = asyncio.Event()
        self._calls: set[asyncio.Future[None]] = set()

    def handle(self, msg: Message) -> Message | bool | None:
        """Every call addressed to logind's object; anything but the kubelet's two calls is
        an unknown method."""
        if msg.message_type != MessageType.METHOD_CALL or msg.path != LOGIND_PATH:
            return None
        if (msg.interface, msg.member, msg.signature) == (PROPERTIES_INTERFACE, "Get", "ss"):
            if list(msg.body) == [MANAGER_INTERFACE, "InhibitDelayMaxUSec"]:
                return Message.new_method_return(msg, "v", [Variant("t", self.delay_usec)])
        elif (msg.interface, msg.member, msg.signature) == (MANAGER_INTERFACE, "Inhibit",
                                                             "ssss"):
            call = asyncio.ensure_future(self._inhibit(msg))
            self._calls.add(call)  # the loop keeps only a weak reference to a task
            call.add_done_callback(self._calls.discard)
            return True
        return Message.new_error(msg, ERROR_UNKNOWN_METHOD,
                                 f"{msg.interface}.{msg.member}({msg.signature}) is not served "
                                 f"by this logind stand-in")

    async def _inhibit(self, msg: Message) -> None:
        what, who, why, mode = msg.body
        if what != "shutdown" or mode != "delay":
            await self.bus.send(Message.new_error(
                msg, ERROR_NOT_SUPPORTED,
                f"only what='shutdown' mode='delay' is served, not what={what!r} "
                f"mode={mode!r}"))
            return
        if self.shutting_down:
            await self.bus.send(Message.new_error(
                msg, ERROR_IN_PROGRESS,
                "The operation inhibition has been requested for is already running"))
            return
        read_end, write_end = os.pipe()
        inhibitor = Inhibitor(what, who, why, mode, read_end)
        self.inhibitors.append(inhibitor)
        asyncio.get_running_loop().add_reader(read_end, self._maybe_released, inhibitor)
        try:
            # The caller holds the lock as long as its copy of the write end is open: ours
            # is closed once the reply (carrying it) is on the socket.
            await self.bus.send(Message.new_method_return(msg, "h", [0], unix_fds=[write_end]))
        finally:
            os.close(write_end)
        print(f"inhibitor taken: {who} ({why}), mode {mode}", flush=True)

    def _maybe_released(self, inhibitor: Inhibitor) -> None:
        try:
            data = os.read(inhibitor.read_end, 64)
        except BlockingIOError:
            return
        if data:
            return  # a holder wrote into its lock; only its closing counts
        asyncio.get_running_loop().remove_reader(inhibitor.read_end)
        os.close(inhibitor.read_end)
        self.inhibitors.remove(inhibitor)
        print(f"inhibitor released: {inhibitor.who}", flush=True)
        if not self.inhibitors:
            self._released.set()

    def holders(self) -> list[str]:
        return [i.who for i in self.inhibitors]

    async def prepare_for_shutdown(self) -> dict[str, Any]:
        """Emit PrepareForShutdown(true) and wait until every delay lock is released or the
        delay has passed; the caller then powers the machine off."""
        self.shutting_down = True
        started = time.monotonic()
        holders = self.holders()
        if self.inhibitors:
            self._released.clear()
        else:
            self._released.set()
        await self.bus.send(Message.new_signal(LOGIND_PATH, MANAGER_INTERFACE,
                                               "PrepareForShutdown", "b", [True]))
        print(f"PrepareForShutdown(true) sent; delay locks held by {holders}", flush=True)
        released = True
        try:
            await asyncio.wait_for(self._released.wait(), self.delay_usec / 1e6)
        except TimeoutError:
            released = False
        seconds = time.monotonic() - started
        print(f"shutdown goes on after {seconds:.1f} s "
              f"({'locks released' if released else 'delay passed'})", flush=True)
        return {"released": released, "seconds": seconds, "holders": holders,
                "still_held": self.holders()}


async def serve(bus_address: str, control_socket: Path, delay_usec: int) -> None:
    bus = await MessageBus(bus_address=bus_address, bus_type=BusType.SYSTEM,
                           negotiate_unix_fd=True).connect()
    logind = Logind(bus, delay_usec)
    bus.add_message_handler(logind.handle)
    reply = await bus.request_name(LOGIND_NAME)
    if reply != RequestNameReply.PRIMARY_OWNER:
        raise SystemExit(f"could not own {LOGIND_NAME} on {bus_address}: {reply}")

    async def control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.closing(writer):
            line = await reader.readline()
            request = json.loads(line or b"{}")
            answer: dict[str, Any]
            if request.get("op") == "holders":
                answer = {"holders": logind.holders()}
            elif request.get("op") == "shutdown":
                answer = await logind.prepare_for_shutdown()
            else:
                answer = {"error": f"unknown request {request!r}: 'holders' or 'shutdown'"}
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()

    control_socket.unlink(missing_ok=True)
    server = await asyncio.start_unix_server(control, path=str(control_socket))
    print(f"serving {LOGIND_NAME} on {bus_address}, InhibitDelayMaxUSec={delay_usec}",
          flush=True)
    async with server:
        await bus.wait_for_disconnect()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])))
