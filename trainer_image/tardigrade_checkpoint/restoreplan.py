"""Restore planning: which saved regions make up each slice a host restores, and how many
bytes of reads may be in flight at once.

A commit marker records one digest per saved region (see digest.py). Matching every target
slice against every saved region costs slices x regions: about 27 s for 300 leaves of 2,048
shards. Saved regions are the chunks of a regular grid (one chunk per piece, see writers.py),
so `RegionIndex` finds the regions of a slice by a binary search per dimension instead;
anything that is not a complete grid (a damaged marker) falls back to the full scan, which
also reports exactly what is missing.

Restores used to start every read before consuming any: a host held the whole state plus
scratch copies in host memory before the first device transfer. `ReadWindow` caps the bytes
of reads started and not yet consumed (as Orbax caps them with `restore_concurrent_gb`,
`base_pytree_checkpoint_handler.py`); the oldest reads are consumed first.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import warnings
from collections.abc import Callable, Mapping

import numpy as np
from tardigrade_contract import contract

from tardigrade_checkpoint import digest

# 4 GiB (the trainer's `checkpoint_restore_inflight_mib`): enough for 16 I/O threads (or
# TensorStore's gcs concurrency) to keep busy with chunks of up to hundreds of MiB; a single
# slice larger than this is still read, alone.
DEFAULT_INFLIGHT_BYTES = contract.DEFAULT_RESTORE_INFLIGHT_MIB << 20


def _grid_edges(keys: list[str], rank: int) -> list[list[int]] | None:
    """Per dimension, the sorted cell boundaries of the grid whose cells are exactly `keys`
    (region keys such as '0:4,0:6'); None if they are not one complete grid."""
    if rank == 0:
        return [] if keys == [""] else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # malformed keys: fewer numbers, caught below
        values = np.fromstring(",".join(keys).replace(":", ","), dtype=np.int64, sep=",")
    if values.size != len(keys) * rank * 2:
        return None
    bounds = values.reshape(len(keys), rank, 2)
    edges = [np.sort(np.array(list(set(bounds[:, d, :].ravel().tolist())), np.int64))
             for d in range(rank)]
    cells = 0
    for d, dim_edges in enumerate(edges):
        start = np.searchsorted(dim_edges, bounds[:, d, 0])
        # A complete grid iff every region is one cell (it spans consecutive edges) ...
        if not np.array_equal(np.searchsorted(dim_edges, bounds[:, d, 1]), start + 1):
            return None
        cells = cells * (len(dim_edges) - 1) + start
    # ... and every cell is recorded exactly once.
    count = math.prod(len(e) - 1 for e in edges)
    if count != len(keys) or not np.all(np.bincount(cells, minlength=count) == 1):
        return None
    return [e.tolist() for e in edges]


class RegionIndex:
    """The recorded regions of one saved leaf, indexed for lookups by box."""

    def __init__(self, recorded: Mapping[str, str], rank: int) -> None:
        self._recorded = recorded
        self._edges = _grid_edges(list(recorded), rank)

    @property
    def is_grid(self) -> bool:
        return self._edges is not None

    def pieces(self, box: digest.Region) -> list[digest.Piece]:
        """The recorded regions that make up `box`, or ValueError if they do not cover it."""
        if self._edges is None or len(box) != len(self._edges):
            # Also what reports a damaged marker: the scan says what is missing.
            return digest.plan_pieces(box, self._recorded)
        ranges = []
        for part, edges in zip(box, self._edges, strict=True):
            first = max(0, bisect.bisect_right(edges, part.start) - 1)
            last = min(len(edges) - 1, bisect.bisect_left(edges, part.stop))
            ranges.append([(edges[i], edges[i + 1]) for i in range(first, last)])
        pieces = []
        covered = 0
        for cell in itertools.product(*ranges):
            region = tuple(slice(a, b) for a, b in cell)
            key = ",".join(f"{a}:{b}" for a, b in cell)
            if key not in self._recorded:  # the same region, spelled differently
                return digest.plan_pieces(box, self._recorded)
            piece = digest.Piece(key, self._recorded[key], region,
                                 all(b.start <= r.start and r.stop <= b.stop
                                     for r, b in zip(region, box, strict=True)))
            overlap = math.prod(max(0, s.stop - s.start) for s in piece.overlap(box))
            if overlap:
                pieces.append(piece)
                covered += overlap
        volume = math.prod(max(0, b.stop - b.start) for b in box)
        if covered != volume:
            raise ValueError(f"recorded regions cover {covered} of the {volume} elements of "
                             f"[{digest.region_key(box, [b.stop for b in box])}]")
        return pieces


class ReadWindow:
    """Reads started and not yet consumed, at most `limit` bytes of them (one read that is
    larger on its own is let through alone). Consumes the oldest first."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the restore's bytes in flight must be >= 1, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self.peak = 0
        self._queue: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()

    def admit(self, nbytes: int) -> None:
        """Consume the oldest reads until `nbytes` more fit; call before starting them."""
        while self._queue and self.in_flight + nbytes > self.limit:
            self._consume_oldest()

    def started(self, nbytes: int, consume: Callable[[], None]) -> None:
        """Reads of `nbytes` were started; `consume` waits for them and uses the data."""
        self._queue.append((nbytes, consume))
        self.in_flight += nbytes
        self.peak = max(self.peak, self.in_flight)

    def drain(self) -> None:
        while self._queue:
            self._consume_oldest()

    def _consume_oldest(self) -> None:
        nbytes, consume = self._queue.popleft()
        consume()
        self.in_flight -= nbytes
