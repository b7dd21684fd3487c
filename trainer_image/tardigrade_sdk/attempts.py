"""Restart in process: the container's main process keeps its imports and runs each attempt
in a child of its own.

With restart in process on, the session's start is a fork point (`run_attempts`). The
container's main process (the keeper) has imported JAX, the model and the user's loop but has
not touched an accelerator (`jax.distributed.initialize` must come before any backend); it
forks, and only the child goes on into the session. A child whose rank was released into a
newer world (inplace.RestartRequests.restarts_in_process) leaves its gang as an exit would and
ends with EXIT_NEXT_ATTEMPT; the keeper then forks the next child, which reads the world the
operator's request left in the pod (inplace.newest_world) and meets the new gang. Any other
end of a child is the container's: the keeper exits with the child's code, or dies of the
child's signal, so the kubelet sees what it would have seen without a keeper.

Why fork rather than exec: a child starts in milliseconds with every module imported (an
exec pays the interpreter's start and the imports again, about 1.3 s for the reference
trainer), and a child that exits releases everything it opened, device files included,
where exec keeps any descriptor not marked close-on-exec (an accelerator a new image could
not open again).

Signals: a container runtime sends its stop signal to the container's main process only
(Kubernetes "Pod Lifecycle", termination of pods; containerd's task kill), so the keeper
forwards SIGTERM and SIGINT to its child. A child dies with the keeper (PR_SET_PDEATHSIG),
as every process of a container dies with its PID 1.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Mapping
from types import FrameType

from tardigrade_contract import contract

from tardigrade_sdk import phases

# A child's word to its keeper: "fork my successor". Never a container's exit code: the
# keeper only exits with codes of children that ended otherwise.
EXIT_NEXT_ATTEMPT = 79
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1

_in_child = False


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether this container restarts its trainer in process (the operator's contract)."""
    return (bool(environ.get(contract.ENV_RESTART_IN_PLACE_DIR))
            and contract.switched_on(environ, contract.ENV_RESTART_IN_PROCESS))


def in_child() -> bool:
    """Whether this process runs an attempt for a keeper (and may end with
    EXIT_NEXT_ATTEMPT to be followed by the next)."""
    return _in_child


def run_attempts() -> None:
    """Fork one child per attempt and return in each child; the keeper itself never returns
    (it exits as its last child did). A no-op in a child."""
    global _in_child
    if _in_child:
        return
    started = phases.process_started()
    keeper = os.getpid()
    child: int | None = None
    pending: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        if child is None:
            pending.append(signum)  # between two children: the next one gets it
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    first = True
    while True:
        sys.stdout.flush()
        sys.stderr.flush()
        forked_at = time.time()
        inherited = len(pending)  # the child re-raises these itself, its handlers restored
        pid = os.fork()
        if pid == 0:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            _die_with_keeper(keeper)
            _in_child = True
            phases.forked(started if first else forked_at, keep_marks=first)
            for sig in pending:
                os.kill(os.getpid(), sig)
            return
        child, first = pid, False
        for sig in pending[inherited:]:  # came between the fork and `child` being set
            os.kill(pid, sig)
        pending.clear()
        _, status = os.waitpid(pid, 0)
        child = None
        code = os.waitstatus_to_exitcode(status)
        if code == EXIT_NEXT_ATTEMPT:
            continue
        _end_as(code)


def _die_with_keeper(keeper: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != keeper:  # the keeper died before the line above took effect
        os._exit(128 + signal.SIGKILL)


def _end_as(code: int) -> None:
    """Exit with the child's code, or die of its signal (`code` < 0)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        # As the container's PID 1 the keeper cannot die of a signal it sent itself (the
        # kernel drops it); the runtime reports 128 + signal for such a death either way.
        if os.getpid() != 1:
            with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have none
                signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
            time.sleep(1)  # delivered before this ends; the exit below is the fallback
        code = 128 - code
    os._exit(code)
