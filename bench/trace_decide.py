"""How far one observation travels through the decision: the operator files one `decide` call
visits, and how often the trace comes back to a file it had already left.

    PYTHONPATH=operator:trainer_image:. python bench/trace_decide.py

The observation is the one of tests/operator/test_decide.py's
`test_preemption_stops_the_gang_and_relaunches_from_the_coordinated_save` at the pass that
sees the preemption (a launched gang of two, rank 0's pod disrupted): the pass that starts a
recovery, which reads the most of the decision. Only that one `decide` call is traced; the
scenario's set-up is not. Restart in place is off (the default): the files it still visits
are the cost of its weaving into the decision. A reader who follows the call in an editor
opens the files in the order printed, so the returns count the jumps back to a file already
read.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from tardigrade_contract import contract

from tests.operator import fake_cluster
from tests.operator.fake_cluster import FakeCluster, spec

PACKAGE = os.sep + "tardigrade_operator" + os.sep


def observation() -> tuple[FakeCluster, Any]:
    cluster = FakeCluster(spec())
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=20)
    cluster.disrupt(cluster.attempt_pods()[0])
    return cluster, cluster.observe()


def trace(decide: Callable[[Any], Any], observed: Any) -> list[str]:
    """The operator files each call and return moves into, in order (repeats collapsed)."""
    path: list[str] = []

    def note(frame: FrameType) -> None:
        name = frame.f_code.co_filename
        if PACKAGE in name:
            short = name.split(PACKAGE, 1)[1]
            if not path or path[-1] != short:
                path.append(short)

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if event in ("call", "return"):
            # On a return the file is the caller's, once the frame has gone.
            note(frame if event == "call" else frame.f_back or frame)
        return tracer

    sys.settrace(tracer)
    try:
        decide(observed)
    finally:
        sys.settrace(None)
    return path


def main() -> None:
    report(trace(fake_cluster.decide, observation()[1]))


def report(path: list[str]) -> None:
    left: set[str] = set()
    returns = 0
    for before, after in itertools.pairwise(path):
        left.add(before)
        if after in left:
            returns += 1
    counts = {f: path.count(f) for f in dict.fromkeys(path)}
    print(f"files visited: {len(counts)}")
    print(f"returns to a file already left: {returns}")
    for name, times in sorted(counts.items(), key=lambda item: -item[1]):
        print(f"  {times:3d}  {name}")


if __name__ == "__main__":
    main()
