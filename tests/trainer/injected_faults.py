"""Faults injected into a trainer at the named points of a save (checkpoint/faults.py).

`ScriptedFaults(hooks, marker_dir)` takes a list of {"point", "action", "step"?, "process"?}
where action is "kill" (SIGKILL itself, like a node loss), "kill_later" (SIGKILL itself
"delay" seconds later, from a timer thread: a kill at an arbitrary moment of whatever runs
next, e.g. the writes of a save), "fail" (raise an OSError(EIO) there, as a storage error
would; with "error": "bug", a RuntimeError, as a bug would), "pause" (write a marker file
`<point>-<step>-<process>` into `marker_dir`, then block until killed) or "hold" (write that
marker, then block until the test creates `<marker>.go` beside it) or "mark" (write that
marker and go on).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from pathlib import Path
from typing import Any

from tardigrade_checkpoint.faults import POINTS


class ScriptedFaults:
    def __init__(self, hooks: list[dict[str, Any]], marker_dir: str | Path) -> None:
        for hook in hooks:
            if hook["point"] not in POINTS:
                raise ValueError(f"unknown fault point {hook['point']!r}: one of {POINTS}")
        self.hooks = hooks
        self.marker_dir = Path(marker_dir)

    def at(self, point: str, step: int, process_id: int) -> None:
        for hook in self.hooks:
            if hook["point"] != point:
                continue
            if hook.get("step") not in (None, step) or hook.get("process") not in (None,
                                                                                  process_id):
                continue
            if hook["action"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif hook["action"] == "kill_later":
                timer = threading.Timer(float(hook["delay"]), os.kill,
                                        (os.getpid(), signal.SIGKILL))
                timer.daemon = True
                timer.start()
            elif hook["action"] == "fail":
                if hook.get("error") == "bug":
                    raise RuntimeError(f"injected bug at {point} of step {step}")
                raise OSError(errno.EIO, f"injected storage fault at {point} of step {step}")
            elif hook["action"] == "pause":
                (self.marker_dir / f"{point}-{step}-{process_id}").write_text(str(os.getpid()))
                threading.Event().wait()
            elif hook["action"] == "mark":
                (self.marker_dir / f"{point}-{step}-{process_id}").write_text(str(os.getpid()))
            elif hook["action"] == "hold":
                marker = self.marker_dir / f"{point}-{step}-{process_id}"
                marker.write_text(str(os.getpid()))
                released = marker.with_name(marker.name + ".go")
                woken = threading.Event()
                while not released.exists():
                    woken.wait(0.02)  # a file the test writes: nothing to block on
