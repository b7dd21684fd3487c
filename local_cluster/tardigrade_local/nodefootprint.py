"""What a real node has on the machine outside its processes' memory, found and removed.

A real node (`realnode.py`) is known by its directory and its id (`tdg-<hash>`): its network
namespace `/run/netns/<id>`, its cgroups `/<id>` in every hierarchy, its mounts under the
directory, the kubelet's log links to it in /var/log/containers, and its processes (in its
cgroups or namespace, or naming its directory: containerd's shims); on a cluster network
(`nodenet.py`) a veth pair whose ends are in its namespace and the cluster's, none on the
host (`host_links`). `NodeFootprint` lists
them (`leftovers`, what a test asserts empty) and removes them (`clear`), also for a node
whose starter was killed (nothing else knows about its processes then).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

# The kubelet links each container's log here, a path compiled in (`ContainerLogsDir`,
# pkg/kubelet/kubelet.go), not under its root directory; the links go when the node stops.
CONTAINER_LOG_LINKS = Path("/var/log/containers")
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def cgroup_hierarchies(v2: bool = True) -> list[Path]:
    """The mount point of every cgroup hierarchy: the v1 ones (where the kubelet wants its
    cgroupRoot to exist before it starts) and, with `v2`, the hybrid cgroup2 one at
    `unified`, where runc and the kubelet make the node's cgroups too."""
    types = ("cgroup", "cgroup2") if v2 else ("cgroup",)
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mountpoint, fstype, *_ = line.split()
        if fstype in types:
            found.append(Path(mountpoint))
    return found


# What `NodeFootprint.leftovers` reports, by kind.
LEFTOVER_KINDS = ("processes", "mounts", "cgroups", "log_links", "netns", "host_links")


class NodeFootprint:
    def __init__(self, directory: Path, node_id: str) -> None:
        self.directory = directory
        self.id = node_id

    @property
    def netns_path(self) -> Path:
        return Path("/run/netns") / self.id

    @property
    def cgroup_root(self) -> str:
        return f"/{self.id}"

    def clear(self) -> None:
        """SIGKILL the node's processes, unmount what is under its directory, remove its
        cgroups (deepest first), log links and network namespace. Idempotent."""
        self._kill_leftovers()
        self._unmount_all()
        self._remove_cgroups()
        for link in self.log_links():
            link.unlink(missing_ok=True)
        if self.netns_path.exists():
            subprocess.run(["ip", "netns", "del", self.id], capture_output=True)

    def processes(self) -> list[int]:
        """Processes of this node still alive: any in its cgroups, in its network namespace
        (containerd, kubelet, shims, containers) or naming its directory (a shim)."""
        found: set[int] = set()
        for hierarchy in cgroup_hierarchies():
            root = hierarchy / self.id
            if root.is_dir():
                for procs in root.rglob("cgroup.procs"):
                    with contextlib.suppress(OSError, ValueError):
                        found.update(int(p) for p in procs.read_text().split())
        marker = (str(self.directory) + "/").encode()
        # Only while the namespace is mounted: a freed namespace's inode number is soon
        # another's.
        netns = None
        with contextlib.suppress(OSError):
            netns = self.netns_path.stat().st_ino
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if netns is not None and (entry / "ns" / "net").stat().st_ino == netns:
                    found.add(int(entry.name))
                    continue
                if marker in (entry / "cmdline").read_bytes():
                    found.add(int(entry.name))
        return sorted(found)

    def _kill_leftovers(self) -> None:
        for _ in range(3):
            pids = self.processes()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)

    def mounts(self) -> list[str]:
        """Mount points under the node's directory, deepest first."""
        found = []
        prefix = str(self.directory) + "/"
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            mountpoint = line.split()[4].encode().decode("unicode_escape")
            if mountpoint.startswith(prefix) or mountpoint == str(self.directory):
                found.append(mountpoint)
        return sorted(found, key=len, reverse=True)

    def _unmount_all(self) -> None:
        for _ in range(3):
            points = self.mounts()
            if not points:
                return
            for point in points:
                _libc.umount2(point.encode(), _MNT_DETACH)

    def cgroups(self) -> list[Path]:
        """The node's cgroups that still exist, deepest first."""
        found: list[Path] = []
        for hierarchy in cgroup_hierarchies():
            root = hierarchy / self.id
            if root.is_dir():
                found += [p for p in root.rglob("*") if p.is_dir()] + [root]
        return sorted(found, key=lambda p: len(p.parts), reverse=True)

    def _remove_cgroups(self) -> None:
        for path in self.cgroups():
            with contextlib.suppress(OSError):
                path.rmdir()

    def log_links(self) -> list[Path]:
        """The kubelet's links to this node's container logs in /var/log/containers."""
        if not CONTAINER_LOG_LINKS.is_dir():
            return []
        prefix = str(self.directory) + "/"
        return [link for link in CONTAINER_LOG_LINKS.iterdir()
                if link.is_symlink() and os.readlink(link).startswith(prefix)]

    def host_links(self) -> list[str]:
        """Links in the host's namespace named after this node (a veth end of its cluster
        network link, `nodenet.py`, would be; there must be none)."""
        out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                             text=True).stdout
        names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()
                 if line.count(":") >= 2]
        return [name for name in names if name.startswith(self.id)]

    def nothing_left(self) -> dict[str, list[str]]:
        """What `leftovers` says once nothing is left (every kind it looks for, empty)."""
        return {kind: [] for kind in LEFTOVER_KINDS}

    def leftovers(self) -> dict[str, list[str]]:
        """What of this node is still on the machine (all empty once stopped)."""
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return {"processes": [str(p) for p in self.processes()], "mounts": self.mounts(),
                "cgroups": [str(p) for p in self.cgroups()],
                "log_links": [str(p) for p in self.log_links()],
                "netns": [line for line in netns.splitlines() if line.split()[:1] == [self.id]],
                "host_links": self.host_links()}
