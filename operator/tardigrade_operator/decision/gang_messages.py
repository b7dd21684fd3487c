"""How many ranks run, as the job's status says it while a gang comes up. Pure.

The status is written only when it changes (kube.StatusWriter), so a message that counted
every rank would cost one TrainingJob status write per rank that starts: hundreds for a large
gang. The count is reported by quarter of the gang instead ("64-127/256 ranks running"): at
most five messages per launch whatever the gang's size, each of them true, and exact for
gangs of up to four ranks. Pods waiting for capacity are counted the same way.
"""

from __future__ import annotations

import math

QUARTERS = 4


def bounds(replicas: int) -> list[int]:
    """The first count of each quarter, then the whole gang: [0, ceil(N/4), ..., N]."""
    return sorted({math.ceil(q * replicas / QUARTERS) for q in range(QUARTERS + 1)})


def running_range(running: int, replicas: int) -> tuple[int, int]:
    """The (lowest, highest) count of the quarter `running` falls in."""
    if replicas <= 0:
        return 0, 0
    running = min(max(running, 0), replicas)
    edges = bounds(replicas)
    low = max(edge for edge in edges if edge <= running)
    if low == replicas:
        return replicas, replicas
    return low, edges[edges.index(low) + 1] - 1


def quarter(count: int, replicas: int) -> str:
    """`count` of the gang as its quarter says it: "64-127", or the number when exact."""
    low, high = running_range(count, replicas)
    return str(low) if low == high else f"{low}-{high}"


def ranks_running(attempt: int, running: int, replicas: int) -> str:
    """The status message of a gang with `running` of its `replicas` ranks up."""
    return f"attempt {attempt}: {quarter(running, replicas)}/{replicas} ranks running"
