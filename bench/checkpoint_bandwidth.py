"""Checkpoint save/restore bandwidth against raw disk and orbax, in one run on one machine.

    python bench/checkpoint_bandwidth.py --gib 1 [--dir DIR] [--devices 4] [--repeats 2]

Prints, for a sharded float32 state of about --gib GiB:
  * raw disk write (write + fsync) and read bandwidth of one file, dd-style: the baseline;
  * tardigrade CheckpointManager save/restore bandwidth and their ratio to the baseline;
  * training-loop time blocked per async save (steady state, i.e. the second save; the first
    one is printed too), absolute and as a fraction of the full save;
  * the same figures for orbax-checkpoint's StandardCheckpointer on the same state.
Page-cache copies of every file are evicted (posix_fadvise DONTNEED) before each read so
restores measure the disk, not memory. The best of --repeats runs is reported per figure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 64 << 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    parser.add_argument("--devices", type=int, default=4, help="CPU devices to shard over")
    parser.add_argument("--arrays", type=int, default=16, help="number of state leaves")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-checksum", action="store_true", help="skip crc32c per chunk")
    parser.add_argument("--skip-orbax", action="store_true")
    return parser.parse_args()


def evict(path: Path) -> None:
    """Flush and drop a file or a tree from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_disk(scratch: Path, nbytes: int) -> tuple[float, float]:
    """dd-style: sequential 64 MiB writes, fsync, then sequential reads of the evicted file."""
    block = os.urandom(BLOCK)
    path = scratch / "raw.bin"
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, block[: min(BLOCK, nbytes - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
    write_s = time.perf_counter() - started
    evict(path)
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, BLOCK):
            pass
    finally:
        os.close(fd)
    read_s = time.perf_counter() - started
    path.unlink()
    return nbytes / write_s, nbytes / read_s


def main() -> int:
    args = parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_image"))

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from tardigrade_trainer.checkpoint import CheckpointManager, KeepLast

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
    gb = 1e9
    results: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        results.setdefault(key, []).append(value)

    try:
        for repeat in range(args.repeats):
            write_bw, read_bw = raw_disk(scratch, nbytes)
            record("raw_write", write_bw)
            record("raw_read", read_bw)

            root = scratch / f"tardigrade-{repeat}"
            manager = CheckpointManager(str(root), checksum=not args.no_checksum,
                                        keep=KeepLast(2))
            # The first save compiles the snapshot copy; a training loop pays that once.
            record("ours_blocked_first", manager.save(1, state))
            manager.wait()
            started = time.perf_counter()
            blocked = manager.save(2, state)
            manager.wait()
            total = time.perf_counter() - started
            record("ours_save", nbytes / total)
            record("ours_blocked", blocked)
            record("ours_blocked_frac", blocked / total)
            evict(root)
            started = time.perf_counter()
            restored, _ = manager.restore(2, target)
            jax.block_until_ready(restored)
            record("ours_restore", nbytes / (time.perf_counter() - started))
            assert all(np.array_equal(restored[k], state[k]) for k in ("layer00",))
            manager.close()
            del restored
            shutil.rmtree(root)

            if not args.skip_orbax:
                import orbax.checkpoint as ocp

                checkpointer = ocp.StandardCheckpointer()
                started = time.perf_counter()
                checkpointer.save(scratch / f"orbax-warmup-{repeat}", state)
                record("orbax_blocked_first", time.perf_counter() - started)
                checkpointer.wait_until_finished()
                shutil.rmtree(scratch / f"orbax-warmup-{repeat}")
                path = scratch / f"orbax-{repeat}"
                started = time.perf_counter()
                checkpointer.save(path, state)
                blocked = time.perf_counter() - started
                checkpointer.wait_until_finished()
                total = time.perf_counter() - started
                record("orbax_save", nbytes / total)
                record("orbax_blocked", blocked)
                record("orbax_blocked_frac", blocked / total)
                evict(path)
                started = time.perf_counter()
                restored = checkpointer.restore(path, target)
                jax.block_until_ready(restored)
                record("orbax_restore", nbytes / (time.perf_counter() - started))
                checkpointer.close()
                del restored
                shutil.rmtree(path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    best = {k: (min(v) if "blocked" in k else max(v)) for k, v in results.items()}
    print(f"state: {nbytes / (1 << 30):.2f} GiB in {args.arrays} float32 arrays sharded over "
          f"{args.devices} CPU devices; best of {args.repeats}; checksum="
          f"{'off' if args.no_checksum else 'crc32c'}")
    print(f"raw disk (dd-style, fsync):  write {best['raw_write'] / gb:6.2f} GB/s   "
          f"read {best['raw_read'] / gb:6.2f} GB/s")
    for name in ("ours", "orbax"):
        if f"{name}_save" not in best:
            continue
        label = "tardigrade" if name == "ours" else "orbax StandardCheckpointer"
        print(f"{label + ':':28s} save  {best[f'{name}_save'] / gb:6.2f} GB/s "
              f"({best[f'{name}_save'] / best['raw_write']:.2f}x raw)   "
              f"restore {best[f'{name}_restore'] / gb:6.2f} GB/s "
              f"({best[f'{name}_restore'] / best['raw_read']:.2f}x raw)   "
              f"blocked {best[f'{name}_blocked'] * 1e3:7.1f} ms per save "
              f"({best[f'{name}_blocked_frac']:.1%} of the full save; first save "
              f"{best[f'{name}_blocked_first'] * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
