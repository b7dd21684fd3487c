"""What runs a pod's containers: local processes, or simulated ones (`simulated.py`).

The pod worker (`worker.py`) owns the pod's lifecycle and status and asks a runtime only for
containers: start, wait for the exit, deliver signals, terminate with a grace period. That is
the line the kubelet draws between itself and the container runtime (CRI), so every
disruption the kubelet drives (node shutdown, eviction, deletion, node loss) reaches real and
simulated containers through the same code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from tardigrade_local.kubelet.process import ContainerProcess


class Container(Protocol):
    oom_killed: bool

    @property
    def pid(self) -> int | None: ...

    async def start(self) -> int:
        """Start it; its process id. OSError: the runtime could not start it (StartError)."""

    async def wait(self) -> int:
        """Its exit, as asyncio reports it (-N for death by signal N)."""

    def signal_group(self, sig: int) -> None: ...

    async def terminate(self, grace_seconds: float) -> None:
        """SIGTERM, SIGKILL after the grace; returns once it is gone."""


class ContainerRuntime(Protocol):
    # The scheme of container IDs it reports (`<scheme>://<id>`, as `containerd://...`).
    scheme: str
    # Whether its containers are host processes the cluster may find again from pid files.
    host_processes: bool

    def container(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path,
                  log_path: Path, memory_limit_bytes: int | None) -> Container: ...


class ProcessRuntime:
    """Each container is a local process group (`process.py`)."""

    scheme = "local"
    host_processes = True

    def container(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path,
                  log_path: Path, memory_limit_bytes: int | None) -> Container:
        return ContainerProcess(argv, env, cwd, log_path, memory_limit_bytes)
