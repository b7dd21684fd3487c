"""Where a job is in its life, from its status alone: the one place that says so. Pure.

The status is written before the operator acts (decide.py), so it records what is under way:
a relaunch recorded but not yet launched (the newest recovery names an attempt past the
current one), a launch written but not yet seen through (the Running condition's reason), a
suspension, an end. Every pass, and the handler's choice of when to look again, start here.
"""

from __future__ import annotations

import enum

from tardigrade_operator.api.types import Recovery, TrainingJobStatus

TERMINAL_PHASES = ("Succeeded", "Failed")
# Reason of the Running condition from the status write that launches a gang until a pass has
# seen every one of its pods: ranks missing meanwhile were never created, not lost.
LAUNCHING = "Launching"


class Stage(enum.Enum):
    NEW = "New"  # no gang launched yet and none recorded: the first launch comes next
    RECOVERING = "Recovering"  # a relaunch is recorded: stop the old gang, back off, launch
    LAUNCHING = "Launching"  # a launch is written; not every rank has been seen since
    RUNNING = "Running"  # the current attempt's gang is launched: watch it
    SUSPENDED = "Suspended"  # stopped on spec.suspend, no relaunch recorded
    FINISHED = "Finished"  # Succeeded or Failed: nothing runs again


def stage(status: TrainingJobStatus) -> Stage:
    """The job's stage. The order is the precedence: an ended job stays ended, a recorded
    relaunch is carried out even while suspended (the teardown then stops before the launch),
    and a job suspended before its first launch is still new."""
    if status.phase in TERMINAL_PHASES:
        return Stage.FINISHED
    if pending_recovery(status) is not None:
        return Stage.RECOVERING
    if status.attempt == 0:
        return Stage.NEW
    if status.phase in ("Suspended", "Queued"):  # Queued: held by Kueue (queueing.py)
        return Stage.SUSPENDED
    running = next((c for c in status.conditions if c.type == "Running"), None)
    if running is not None and running.reason == LAUNCHING:
        return Stage.LAUNCHING
    return Stage.RUNNING


def launched_by(status: TrainingJobStatus) -> Recovery | None:
    """The recovery that launched the current attempt, if one did."""
    last = status.recoveries[-1] if status.recoveries else None
    return last if last is not None and last.attempt == status.attempt else None


def pending_recovery(status: TrainingJobStatus) -> Recovery | None:
    """The recorded relaunch not yet launched: its attempt is past the current one."""
    if status.recoveries and status.recoveries[-1].attempt > status.attempt:
        return status.recoveries[-1]
    return None
