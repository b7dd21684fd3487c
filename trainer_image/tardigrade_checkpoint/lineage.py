"""Which commit markers make up the current line of a checkpoint root.

Restoring a step older than the newest one starts a new line (a branch) from it. The root
record (rootrecord.py) names the current branch and every branch's parent and fork step, and
is replaced with one object write: that write is the moment the new line supersedes the old
one for `latest`. A marker counts for the current line when it was committed on the current
branch, or on an ancestor at or before the step the line forked from it; and when the fence
admits it (see `admitted`). Pure functions: no storage access here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

# Markers written before format 2 carry no lineage: they belong to the first branch of a root.
LEGACY_LINEAGE = ""


@dataclasses.dataclass(frozen=True)
class Branch:
    """One line of checkpoints: forked from `parent` at `fork_step` (None: from nothing)."""

    parent: str | None = None
    fork_step: int | None = None
    # The rollback request (spec.checkpoint.restoreStep) that created it: applied once only.
    request: str | None = None


@dataclasses.dataclass(frozen=True)
class MarkerLine:
    """What lineage and fencing need of one commit marker."""

    step: int
    lineage: str = LEGACY_LINEAGE
    owner_uid: str | None = None
    attempt: int | None = None


@dataclasses.dataclass(frozen=True)
class Fence:
    """The newest attempt of the owning job that started, and the newest step of the line
    that attempt saw when it started: older gangs may only have committed up to there."""

    owner_uid: str
    attempt: int
    base_step: int  # -1: the line was empty


def on_line(branches: Mapping[str, Branch], current: str, lineage: str, step: int) -> bool:
    """True if a marker of `lineage` at `step` belongs to the line ending in `current`."""
    bound: float = math.inf
    name: str | None = current
    seen: set[str] = set()
    while name is not None and name not in seen:
        if lineage == name:
            return step <= bound
        seen.add(name)
        branch = branches.get(name)
        if branch is None:
            return False
        if branch.fork_step is not None:
            bound = min(bound, branch.fork_step)
        name = branch.parent
    return False


def admitted(fence: Fence | None, marker: MarkerLine) -> bool:
    """False for a commit that a fenced-off gang (an older attempt, or a deleted job that had
    the same name) slipped in after the newest attempt took over the root."""
    if fence is None or marker.step <= fence.base_step:
        return True
    return (marker.owner_uid == fence.owner_uid and marker.attempt is not None
            and marker.attempt >= fence.attempt)


def line_steps(markers: Iterable[MarkerLine], branches: Mapping[str, Branch] | None,
               current: str, fence: Fence | None) -> list[int]:
    """Committed steps of the current line, ascending. Without branches (a root that has no
    record yet) every marker counts, as before lineage existed."""
    steps = {
        m.step for m in markers
        if (branches is None or on_line(branches, current, m.lineage, m.step))
        and admitted(fence, m)
    }
    return sorted(steps)
