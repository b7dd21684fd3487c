"""Fault-injection points for tests: kill, fail or pause this process at a named point.

Set TARDIGRADE_TEST_HOOKS to a JSON list of {"point", "action", "step"?, "process"?} where
action is "kill" (SIGKILL itself, like a node loss), "kill_later" (SIGKILL itself
"delay" seconds later, from a timer thread: a kill at an arbitrary moment of whatever runs
next, e.g. the writes of a save), "fail" (raise an OSError(EIO) there, as a storage
error would; with "error": "bug", a RuntimeError, as a bug would) or "pause" (write a
marker file into TARDIGRADE_TEST_HOOK_DIR, then block until killed). Unset in production:
`hit` is a no-op.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
from typing import Any

ENV_HOOKS = "TARDIGRADE_TEST_HOOKS"
ENV_HOOK_DIR = "TARDIGRADE_TEST_HOOK_DIR"

_hooks: list[dict[str, Any]] | None = None


def _load() -> list[dict[str, Any]]:
    global _hooks
    if _hooks is None:
        _hooks = json.loads(os.environ.get(ENV_HOOKS) or "[]")
    return _hooks


def hit(point: str, step: int, process_id: int) -> None:
    for hook in _load():
        if hook["point"] != point:
            continue
        if hook.get("step") not in (None, step) or hook.get("process") not in (None, process_id):
            continue
        if hook["action"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif hook["action"] == "kill_later":
            timer = threading.Timer(float(hook["delay"]), os.kill, (os.getpid(), signal.SIGKILL))
            timer.daemon = True
            timer.start()
        elif hook["action"] == "fail":
            if hook.get("error") == "bug":
                raise RuntimeError(f"injected bug at {point} of step {step}")
            raise OSError(errno.EIO, f"injected storage fault at {point} of step {step}")
        elif hook["action"] == "pause":
            marker = os.path.join(os.environ[ENV_HOOK_DIR], f"{point}-{step}-{process_id}")
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            threading.Event().wait()
