"""A real node's power: the system bus and logind a VM has, its shutdown, and its loss.

Each real node (`realnode.RealNode`) gets, as a VM has, a system bus (Debian's dbus-daemon
with a configuration of ours, its socket under the node's short socket directory) and logind
on it: the stand-in of `logind.py`, which serves the kubelet's graceful node shutdown and
nothing more. The kubelet finds the bus through `DBUS_SYSTEM_BUS_ADDRESS`, which godbus's
`SystemBus()` honours.

- `shutdown`: what a VM's shutdown does (a spot reclaim, a maintenance event): logind emits
  `PrepareForShutdown(true)`, waits until the kubelet releases its delay lock or
  `InhibitDelayMaxUSec` passes, then the machine powers off: everything on it dies at once;
- `halt`: a VM lost without a shutdown: everything on it dies at once, with no notice.

The kubelet is configured with GKE's grace (`KUBELET_SHUTDOWN_CONFIG`), and logind reports an
`InhibitDelayMaxUSec` of that whole grace: what a GKE node's logind reports once the kubelet's
override is in place, so the kubelet never writes its override (into the host's /etc, since
the kubelet shares the host's filesystem here) nor asks systemd to reload logind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from tardigrade_local.gke.disruptions import (
    SHUTDOWN_GRACE_PERIOD_CRITICAL_PODS_SECONDS,
    SHUTDOWN_GRACE_PERIOD_SECONDS,
)

LOGIND_NAME = "org.freedesktop.login1"
BUS_SOCKET = "system_bus_socket"
CONTROL_SOCKET = "logind.control"
# GKE's grace for spot VMs (disruptions.py; GKE on AWS/Azure "Graceful node shutdown" pages:
# ShutdownGracePeriod 30 s, ShutdownGracePeriodCriticalPods 15 s, the kubelet "instructing
# systemd to delay the system shutdown"), in the kubelet's configuration. The feature gate
# GracefulNodeShutdown is on by default (beta since 1.21, still beta in 1.36:
# pkg/features/kube_features.go; Kubernetes "Node Shutdowns" page), so these two settings are
# what turns it on.
KUBELET_SHUTDOWN_CONFIG = {
    "shutdownGracePeriod": f"{SHUTDOWN_GRACE_PERIOD_SECONDS:g}s",
    "shutdownGracePeriodCriticalPods": f"{SHUTDOWN_GRACE_PERIOD_CRITICAL_PODS_SECONDS:g}s",
}
# What the kubelet asks logind for (`podManager.periodRequested`: the sum of its priority
# groups' grace, 15 s + 15 s), in microseconds as logind reports it.
INHIBIT_DELAY_MAX_USEC = int(SHUTDOWN_GRACE_PERIOD_SECONDS * 1_000_000)
KUBELET_LOCK_HOLDER = "kubelet"  # the `who` of the kubelet's Inhibit call


class PowerError(RuntimeError):
    pass


def bus_config(socket_path: Path) -> str:
    """A dbus-daemon configuration for one node's system bus: listening on `socket_path`
    only, reading no file of the host's (no `<includedir>`, no service directories: nothing is
    activated), and letting the node's root processes own logind's name and call it."""
    return f"""<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={escape(str(socket_path))}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="root"/>
    <allow own="{LOGIND_NAME}"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>
</busconfig>
"""


class LogindControl:
    """The node's side of the logind stand-in's control socket (JSON lines)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(self.path))
            sock.sendall(json.dumps(request).encode() + b"\n")
            with sock.makefile("rb") as answer:
                return dict(json.loads(answer.readline()))

    def holders(self) -> list[str] | None:
        """Who holds a delay lock; None while the stand-in does not answer (yet)."""
        try:
            return list(self._ask({"op": "holders"}, timeout=10)["holders"])
        except (OSError, ValueError, KeyError):
            return None

    def prepare_for_shutdown(self, timeout: float) -> dict[str, Any]:
        """PrepareForShutdown(true); returns once the locks are released or the delay passed:
        `{"released": bool, "seconds": float, "holders": [...], "still_held": [...]}`."""
        return self._ask({"op": "shutdown"}, timeout=timeout)


def bus_commands(node_directory: Path, socket_dir: Path, python: str,
                 delay_usec: int = INHIBIT_DELAY_MAX_USEC,
                 ) -> tuple[list[str], list[str], dict[str, str]]:
    """The bus daemon's and the logind stand-in's command lines, and the environment that
    points the kubelet at the bus. Writes the bus's configuration under the node's `etc`."""
    bus_socket = socket_dir / BUS_SOCKET
    config = node_directory / "etc" / "system-bus.conf"
    config.write_text(bus_config(bus_socket))
    address = f"unix:path={bus_socket}"
    daemon = ["dbus-daemon", f"--config-file={config}", "--nofork", "--nopidfile",
              "--nosyslog"]
    logind = [python, "-m", "tardigrade_local.logind", address,
              str(socket_dir / CONTROL_SOCKET), str(delay_usec)]
    return daemon, logind, {"DBUS_SYSTEM_BUS_ADDRESS": address}


def kill_at_once(pids: Iterable[int]) -> None:
    """SIGKILL every one of `pids` in one pass (the first ones first)."""
    for pid in dict.fromkeys(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def reap(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.wait(30)
