"""Restore planning at scale: the saved regions that make up each slice a host restores.

    python bench/restore_planning.py [--leaves 300] [--grid 64x32] [--target 32x32] [--devices 8]

A checkpoint of --leaves 2-D leaves, each saved as a --grid of shards (64x32 = 2,048 regions,
one digest each in the commit marker), restored by one host holding --devices slices of each
leaf on a --target grid (another mesh: each slice straddles several saved regions). Times
planning alone, from the commit marker's digests (region key -> digest) to the pieces of
every slice, for both planners in the same run:
  * old: `digest.plan_pieces`, a scan of every saved region for every slice;
  * new: `restoreplan.RegionIndex`, built once per leaf, then a lookup per slice.
Prints seconds, the ratio old/new, and whether both found the same pieces. Target: the new
planner under 1 s for 300 leaves x 2,048 shards.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

TARGET_SECONDS = 1.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", type=int, default=300)
    parser.add_argument("--grid", default="64x32", help="saved shards per dimension")
    parser.add_argument("--target", default="32x32", help="restore slices per dimension")
    parser.add_argument("--devices", type=int, default=8, help="slices this host restores")
    parser.add_argument("--cell", type=int, default=16, help="elements per saved shard side")
    return parser.parse_args()


def grid_regions(shape: tuple[int, int], grid: tuple[int, int]) -> list[tuple[slice, ...]]:
    rows, cols = shape[0] // grid[0], shape[1] // grid[1]
    return [(slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
            for i in range(grid[0]) for j in range(grid[1])]


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_image"))
    from tardigrade_checkpoint import digest, restoreplan

    grid = tuple(int(x) for x in args.grid.split("x"))
    target = tuple(int(x) for x in args.target.split("x"))
    shape = (grid[0] * args.cell, grid[1] * args.cell)
    if not (len(grid) == len(target) == 2
            and all(s % t == 0 for s, t in zip(shape, target, strict=True))):
        raise SystemExit(f"--grid {args.grid} and --target {args.target} must be AxB and the "
                         f"target must divide the {shape} elements evenly")
    leaves = []
    for leaf in range(args.leaves):
        recorded = {digest.region_key(r, shape): f"{leaf:08x}{i:024x}"
                    for i, r in enumerate(grid_regions(shape, grid))}
        # This host's slices: spread over the target grid, as a host's devices are.
        slices = grid_regions(shape, target)
        step = max(1, len(slices) // args.devices)
        leaves.append((recorded, slices[::step][: args.devices]))

    started = time.perf_counter()
    new_pieces = []
    grids = 0
    for recorded, boxes in leaves:
        index = restoreplan.RegionIndex(recorded, 2)
        grids += index.is_grid
        new_pieces.append([sorted(p.key for p in index.pieces(box)) for box in boxes])
    new = time.perf_counter() - started

    started = time.perf_counter()
    old_pieces = [[sorted(p.key for p in digest.plan_pieces(box, recorded)) for box in boxes]
                  for recorded, boxes in leaves]
    old = time.perf_counter() - started

    regions = len(leaves[0][0])
    same = old_pieces == new_pieces
    print(f"{args.leaves} leaves x {regions} saved regions, {args.devices} slices per leaf on "
          f"this host (saved grid {args.grid}, target grid {args.target}); load average "
          f"{os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    print(f"old (scan every region per slice): {old:8.3f} s")
    print(f"new (index per leaf, then lookup): {new:8.3f} s   ratio old/new {old / new:.0f}x")
    print(f"same pieces: {same}; leaves planned by grid lookup: {grids} of {args.leaves}")
    if not same or grids != args.leaves:
        print("target not judged: the new planner did not take the grid path for every leaf "
              "or disagreed with the old one")
        return 1
    verdict = "met" if new < TARGET_SECONDS else "MISSED"
    print(f"target: new < {TARGET_SECONDS:.0f} s: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
