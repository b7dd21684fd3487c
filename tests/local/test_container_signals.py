"""A process container's stop signal goes to its main process alone, as a runtime sends it to
the container's PID 1; what that process started dies with it (local_cluster/README.md, "Stop
signals")."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import psutil
from tardigrade_local.kubelet.process import ContainerProcess

from tests.polling import wait_for

# The main process starts a child that would note a SIGTERM, then waits for its own: it
# exits 0 on SIGTERM, leaving the child to the runtime.
MAIN = """
import os, signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", '''
import pathlib, signal, sys
signal.signal(signal.SIGTERM, lambda *_: pathlib.Path(sys.argv[1]).write_text("got it"))
pathlib.Path(sys.argv[2]).write_text("ready")
while True:
    signal.pause()
''', sys.argv[1], sys.argv[2]])
with open(sys.argv[3], "w") as f:
    f.write(str(child.pid))
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
while True:
    signal.pause()
"""


def test_stop_signals_the_main_process_only_and_its_children_die_with_it(tmp_path: Path):
    noted, ready, child_pid = tmp_path / "noted", tmp_path / "ready", tmp_path / "child.pid"

    async def run() -> int:
        proc = ContainerProcess([sys.executable, "-c", MAIN, str(noted), str(ready),
                                 str(child_pid)], env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path,
                                log_path=tmp_path / "log")
        await proc.start()
        waiter = asyncio.ensure_future(proc.wait())
        async with asyncio.timeout(60):
            while not ready.exists() or not child_pid.exists():
                await asyncio.sleep(0.02)
        await proc.terminate(30.0)
        return await waiter

    assert asyncio.run(run()) == 0
    assert not noted.exists(), "the main process's child got the container's stop signal"
    pid = int(child_pid.read_text())

    def gone() -> bool:
        # SIGKILL is sent when the main process is reaped; the child's exit takes its own
        # moment to finish. Orphaned, it is reaped by whoever adopted it, or stays a zombie.
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_for(gone, 10, "the main process's child to die with it")
