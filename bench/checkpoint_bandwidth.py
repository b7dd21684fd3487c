"""Checkpoint save/restore bandwidth against raw disk and orbax, in one run on one machine.

    python bench/checkpoint_bandwidth.py --gib 1 [--dir DIR] [--devices 4] [--repeats 5]

Prints, for a sharded float32 state of about --gib GiB:
  * raw disk write (write + fsync) and read bandwidth of one file, dd-style: the baseline;
  * tardigrade CheckpointManager save/restore bandwidth and their ratio to the baseline, as
    configured by default (XXH3 digests of every shard in the commit marker, checked on
    restore) and with the optional zarr crc32c codec on top;
  * training-loop time blocked per async save, absolute and as a fraction of the full save;
  * the same figures for orbax-checkpoint's StandardCheckpointer on the same state.

Fairness rules, each of which changed the figures when broken:
  * one untimed warm-up round first (first save compiles, first restore after a save in the
    same process, first use of fresh memory): a training job pays those once, not per save;
  * `sync` before every timed phase, so that deferred work of the previous one (deleted files,
    journal commits) is not charged to the next;
  * page-cache copies of every file are evicted (fdatasync + POSIX_FADV_DONTNEED) before each
    read, so restores measure the disk, not memory;
  * each ratio pairs a figure with the raw figure of the same round (the machine's load
    drifts within seconds), and the median over rounds is printed with its range;
  * a restore must produce the state in newly allocated memory, so the read baseline reads
    into new buffers (`os.read`) too; the dd-style figure (one reused buffer) is printed
    beside it. On VMs that hand freed pages back to the host the two differ a lot.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BLOCK = 64 << 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    parser.add_argument("--devices", type=int, default=4, help="CPU devices to shard over")
    parser.add_argument("--arrays", type=int, default=16, help="number of state leaves")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds after the warm-up")
    parser.add_argument("--skip-crc", action="store_true",
                        help="skip the tardigrade run with the crc32c codec")
    parser.add_argument("--skip-orbax", action="store_true")
    return parser.parse_args()


def evict(path: Path) -> None:
    """Flush and drop a file or a tree from the page cache."""
    os.sync()
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(action: Callable[[], Any]) -> float:
    os.sync()
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def raw_disk(scratch: Path, nbytes: int) -> dict[str, float]:
    """dd-style: sequential 64 MiB writes, fsync, then sequential reads of the evicted file."""
    block = memoryview(os.urandom(BLOCK))
    path = scratch / "raw.bin"

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            written = 0
            while written < nbytes:
                written += os.write(fd, block[: min(BLOCK, nbytes - written)])
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_into_new_memory() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.read(fd, BLOCK):
                pass
        finally:
            os.close(fd)

    reused = bytearray(BLOCK)

    def read_dd_style() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.readv(fd, [reused]):
                pass
        finally:
            os.close(fd)

    figures = {"write": nbytes / timed(write)}
    evict(path)
    figures["read"] = nbytes / timed(read_into_new_memory)
    evict(path)
    figures["read_dd"] = nbytes / timed(read_dd_style)
    path.unlink()
    return figures


class Tardigrade:
    def __init__(self, root: Path, checksum: bool) -> None:
        from tardigrade_trainer.checkpoint import CheckpointManager, KeepLast

        self.root = root
        self.manager = CheckpointManager(str(root), checksum=checksum, keep=KeepLast(2))

    def save(self, step: int, state: Any) -> float:
        return self.manager.save(step, state)

    def wait(self) -> None:
        self.manager.wait()

    def path(self, step: int) -> Path:
        return self.root

    def restore(self, step: int, target: Any) -> Any:
        return self.manager.restore(step, target)[0]

    def close(self) -> None:
        self.manager.close()
        shutil.rmtree(self.root)


class Orbax:
    def __init__(self, root: Path) -> None:
        import orbax.checkpoint as ocp

        self.root = root
        self.checkpointer = ocp.StandardCheckpointer()

    def save(self, step: int, state: Any) -> float:
        started = time.perf_counter()
        self.checkpointer.save(self.path(step), state)
        return time.perf_counter() - started

    def wait(self) -> None:
        self.checkpointer.wait_until_finished()

    def path(self, step: int) -> Path:
        return self.root / str(step)

    def restore(self, step: int, target: Any) -> Any:
        return self.checkpointer.restore(self.path(step), target)

    def close(self) -> None:
        self.checkpointer.close()
        shutil.rmtree(self.root)


def measure(checkpointer: Tardigrade | Orbax, state: Any, target: Any,
            nbytes: int) -> dict[str, float]:
    import jax
    import numpy as np

    figures = {"blocked_first": checkpointer.save(1, state)}
    checkpointer.wait()
    blocked = 0.0

    def save() -> None:
        nonlocal blocked
        blocked = checkpointer.save(2, state)
        checkpointer.wait()

    total = timed(save)
    figures.update(save=nbytes / total, blocked=blocked, blocked_frac=blocked / total)
    evict(checkpointer.path(2))
    restored = None

    def restore() -> None:
        nonlocal restored
        restored = checkpointer.restore(2, target)
        jax.block_until_ready(restored)

    figures["restore"] = nbytes / timed(restore)
    assert restored is not None
    assert all(np.array_equal(restored[k], state[k]) for k in state), "restore differs"
    del restored
    checkpointer.close()
    return figures


def main() -> int:
    args = parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_image"))

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()).reshape(args.devices), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data", None))
    cols = 1024
    rows = int(args.gib * (1 << 30) / 4 / cols / args.arrays) // args.devices * args.devices
    rng = np.random.default_rng(0)
    state = {
        f"layer{i:02d}": jax.device_put(rng.standard_normal((rows, cols), np.float32), sharding)
        for i in range(args.arrays)
    }
    nbytes = sum(a.nbytes for a in state.values())
    target = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
              for k, a in state.items()}
    scratch = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    contenders: dict[str, Callable[[Path], Tardigrade | Orbax]] = {
        "tardigrade": lambda root: Tardigrade(root, checksum=False)
    }
    if not args.skip_crc:
        contenders["tardigrade + crc32c codec"] = lambda root: Tardigrade(root, checksum=True)
    if not args.skip_orbax:
        contenders["orbax StandardCheckpointer"] = Orbax
    rounds: list[dict[str, dict[str, float]]] = []
    load_before = os.getloadavg()
    try:
        for round_ in range(args.repeats + 1):
            figures = {"raw": raw_disk(scratch, nbytes)}
            for name, make in contenders.items():
                figures[name] = measure(make(scratch / f"{name}-{round_}".replace(" ", "_")
                                             .replace("+", "")), state, target, nbytes)
            rounds.append(figures)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    load_after = os.getloadavg()

    warmup, timed_rounds = rounds[0], rounds[1:]
    gb = 1e9

    def median(values: list[float]) -> float:
        return statistics.median(values)

    def spread(values: list[float], fmt: str) -> str:
        low, mid, high = (format(v, fmt) for v in (min(values), median(values), max(values)))
        return f"{mid} [{low}-{high}]"

    raw = {k: [r["raw"][k] for r in timed_rounds] for k in ("write", "read", "read_dd")}
    print(f"state: {nbytes / (1 << 30):.2f} GiB in {args.arrays} float32 arrays sharded over "
          f"{args.devices} CPU devices; median [min-max] of {args.repeats} rounds after a "
          f"warm-up; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
          f"({os.cpu_count()} CPUs)")
    print(f"raw disk (fsync):  write {spread([v / gb for v in raw['write']], '.2f')} GB/s   "
          f"read into new memory {spread([v / gb for v in raw['read']], '.2f')} GB/s   "
          f"(dd-style reused buffer {spread([v / gb for v in raw['read_dd']], '.2f')} GB/s)")
    for name in contenders:
        runs = [r[name] for r in timed_rounds]
        save_ratio = [r[name]["save"] / r["raw"]["write"] for r in timed_rounds]
        restore_ratio = [r[name]["restore"] / r["raw"]["read"] for r in timed_rounds]
        restore_dd = [r[name]["restore"] / r["raw"]["read_dd"] for r in timed_rounds]
        print(f"{name}:")
        print(f"    save    {median([f['save'] for f in runs]) / gb:6.2f} GB/s  "
              f"{spread(save_ratio, '.2f')}x raw write")
        print(f"    restore {median([f['restore'] for f in runs]) / gb:6.2f} GB/s  "
              f"{spread(restore_ratio, '.2f')}x raw read into new memory  "
              f"({median(restore_dd):.2f}x dd-style)")
        print(f"    blocked {median([f['blocked'] for f in runs]) * 1e3:6.1f} ms per save  "
              f"{spread([f['blocked_frac'] * 100 for f in runs], '.1f')}% of the full save  "
              f"(first save in the process: {warmup[name]['blocked_first'] * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
