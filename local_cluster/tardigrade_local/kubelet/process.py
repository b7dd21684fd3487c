"""One container = one local process group.

The process leads its own session. The stop signal goes to the main process alone, as a
runtime sends it to the container's PID 1; a kill reaches the whole group, and when the main
process exits the rest of the group is killed, as a PID namespace ends with its PID 1. Its
stdout and stderr go through pipes into a CRI-format log file (`crilog.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import psutil

from tardigrade_local.crilog import CriLogWriter
from tardigrade_local.lifetime import die_with_parent

MEMORY_POLL_SECONDS = 0.5
PIPE_DRAIN_SECONDS = 2.0


class ContainerProcess:
    def __init__(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path,
                 memory_limit_bytes: int | None = None) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self.cwd = cwd
        self.log_path = log_path
        self.memory_limit_bytes = memory_limit_bytes
        self.oom_killed = False
        self._proc: asyncio.subprocess.Process | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._pumps: list[asyncio.Task[None]] = []
        self._log: BinaryIO | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def start(self) -> int:
        """Start the process; OSError means the runtime could not exec it (StartError)."""
        self.cwd.mkdir(parents=True, exist_ok=True)
        # Our own pipes, not asyncio's: its wait() would also wait for every process that
        # inherited them, while a runtime reports the exit of the main process.
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out_w,
                stderr=err_w,
                cwd=self.cwd,
                env=self.env,
                start_new_session=True,
                # The node is this process: its containers die with it, however it dies.
                preexec_fn=die_with_parent,
            )
        except OSError:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in wait()
        self._pumps = [asyncio.create_task(self._pump(out_r, "stdout")),
                       asyncio.create_task(self._pump(err_r, "stderr"))]
        if self.memory_limit_bytes:
            self._monitor = asyncio.create_task(self._watch_memory(self.memory_limit_bytes))
        return self._proc.pid

    async def wait(self) -> int:
        """Wait for the main process; returns its asyncio returncode (-N for signal N)."""
        assert self._proc is not None
        code = await self._proc.wait()
        if self._monitor is not None:
            self._monitor.cancel()
        self.signal_group(signal.SIGKILL)
        if self._pumps:
            # The group is dead, so the pipes close; a process that left the group may hold
            # them open, and is not waited for.
            _, pending = await asyncio.wait(self._pumps, timeout=PIPE_DRAIN_SECONDS)
            for pump in pending:
                pump.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    async def _pump(self, fd: int, stream: str) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        pipe = os.fdopen(fd, "rb", 0)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe)
        assert self._log is not None
        writer = CriLogWriter(self._log, stream)
        try:
            while chunk := await reader.read(65536):
                writer.feed(chunk)
        finally:
            writer.close()
            transport.close()

    def signal_group(self, sig: int) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    async def terminate(self, grace_seconds: float) -> None:
        """SIGTERM the main process, SIGKILL the group after the grace period; returns once
        the main process is gone. A runtime's stop signal goes to the container's PID 1 alone
        (Kubernetes "Pod Lifecycle": the runtime sends TERM "to the main process in each
        container"; containerd's CRI StopContainer kills the task's init process); what that
        process started gets it only if it passes it on."""
        if self._proc is None or self._proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(self._proc.wait()), max(grace_seconds, 0))
        except TimeoutError:
            self.signal_group(signal.SIGKILL)
            await self._proc.wait()

    async def _watch_memory(self, limit: int) -> None:
        # The memory cgroup would kill the container; here the kubelet polls its RSS.
        assert self._proc is not None
        try:
            root = psutil.Process(self._proc.pid)
            while True:
                await asyncio.sleep(MEMORY_POLL_SECONDS)
                procs = [root, *root.children(recursive=True)]
                rss = 0
                for proc in procs:
                    with contextlib.suppress(psutil.Error):
                        rss += proc.memory_info().rss
                if rss > limit:
                    self.oom_killed = True
                    self.signal_group(signal.SIGKILL)
                    return
        except psutil.Error:
            return
