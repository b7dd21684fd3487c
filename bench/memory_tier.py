"""The memory tier's cost to a training loop's throughput, on the CPU, against no tier.

    python bench/memory_tier.py [--state-mib 256] [--step-ms 100] [--interval 5]
                                [--steps 60] [--devices 4] [--json]

One process stands in for one rank: its state (float32 matrices sharded over --devices CPU
devices) is updated by a jitted step calibrated to take about --step-ms, and four arms run
the same loop in the same process, one after the other:
  * none: no memory tier;
  * memory: every --interval steps the rank's shards are copied off the devices (the loop
    waits for that copy), then a background thread commits them to a memory directory
    (`memory_tier.commit`: SHA-256 digests and writes on the session's pool of threads, as
    `tardigrade_sdk.memory_session` does), the loop waiting for the previous commit if it
    still runs (TARDIGRADE_MEMORY_TIER_WHEN_BUSY=wait);
  * memory, skip: the same, but a memory step whose previous commit still runs is skipped
    (at most memory_session.MAX_SKIPS_IN_A_ROW in a row), the session's default;
  * memory+replica: the same, and the snapshot is also sent over loopback HTTP to a replica
    server in this process, which checks it and keeps it (a real rank also receives its
    neighbour's snapshot, so both sides' costs land on the one process, as they do in a gang).
Prints steps per second of each arm and its ratio to `none`, and the loop's blocked seconds
per snapshot (the copy off the devices, and the wait for the previous snapshot's background
work when it outlasts the interval). The memory directory is a tmpfs (/dev/shm) when there
is one, as the pod's emptyDir with medium Memory is.

    python bench/memory_tier.py --commit-only [--commit-gib 1] [--workers 1,8] [--rounds 3]

The commit alone (no loop): a snapshot of --commit-gib GiB in pieces sized like the 184M
reference model's (a 125 MiB embedding, 16 and 4 MiB matrices), each piece brought to the
host by one reader thread in order (a copy: the device reader's part on an accelerator), then
committed by `memory_tier.commit` on a pool of each --workers count, and by the previous
commit (`encode` then `MemoryStore.write`, one thread, after every piece was read) as the
baseline, the arms in turn in each round. Prints the median commit seconds of each arm, its
ratio to the baseline's, and where the time went (read, digest, write, summed over threads).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
KEY = b"bench-memory-tier-key-0123456789abcdef"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mib", type=int, default=256, help="state size on this host")
    parser.add_argument("--step-ms", type=float, default=100.0,
                        help="the step's time without the tier (calibrated)")
    parser.add_argument("--interval", type=int, default=5, help="memory snapshot every N steps")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per arm")
    parser.add_argument("--devices", type=int, default=4, help="CPU devices")
    parser.add_argument("--rounds", type=int, default=2,
                        help="the arms run in turn this many times (drift hits all alike)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-niceness", dest="niceness", action="store_false",
                        help="run the tier's threads at the loop's CPU priority, as before")
    parser.add_argument("--commit-only", action="store_true",
                        help="time the commit alone: one thread against --workers threads")
    parser.add_argument("--commit-gib", type=float, default=1.0, help="snapshot size")
    parser.add_argument("--workers", default="1,8",
                        help="the commit's thread counts to time (comma-separated)")
    return parser.parse_args()


class ReadPiece:
    """A piece the reader thread copies to the host, in order (an accelerator's staged copy,
    which the device reader reads), the way `staging.StagedShard` is taken."""

    def __init__(self, source: Any, reader: Any, read_order: int) -> None:
        import numpy as np

        self.shape, self.dtype, self.nbytes = source.shape, source.dtype, source.nbytes
        self.read_order = read_order
        self._read = reader.submit(np.array, source, copy=True)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        return self._read.result()

    def release(self) -> None:
        pass


def commit_bench(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO / "trainer_image"))
    import shutil
    import statistics

    import numpy as np
    from tardigrade_checkpoint import memory_tier

    mib = 1 << 20
    sizes = [125 * mib]  # the embedding; then attention (4 MiB) and MLP (16 MiB) matrices
    while sum(sizes) < args.commit_gib * (1 << 30):
        sizes += [4 * mib] * 4 + [16 * mib] * 2
    rng = np.random.default_rng(0)
    sources = [rng.standard_normal(size // 4, dtype=np.float32) for size in sizes]
    total = sum(sizes)
    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(prefix="memory-commit-bench-",
                                 dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))
    store = memory_tier.MemoryStore(base, KEY, keep=1)
    reader = concurrent.futures.ThreadPoolExecutor(1)  # one reader, in order
    fields = {"attempt": 0, "owner": 0, "process_count": 1, "lineage": "", "job_uid": "bench"}
    counts = [int(n) for n in args.workers.split(",") if n]
    pools = {n: concurrent.futures.ThreadPoolExecutor(n) for n in counts}
    results: dict[str, list[dict[str, float]]] = {}

    def snapshot() -> Any:
        pieces = [memory_tier.Piece(f"w{i}", f"0:{s.size}", "float32", s.shape,
                                    ReadPiece(s, reader, i)) for i, s in enumerate(sources)]
        arrays = {p.leaf: {"shape": list(p.shape), "dtype": "float32"} for p in pieces}
        return memory_tier.Snapshot(arrays, pieces)

    step = 0
    try:
        for _ in range(args.rounds):
            # The baseline: every piece read, then digested and written on one thread.
            step += 1
            started = time.perf_counter()
            snap = snapshot()
            manifest, buffers = memory_tier.encode(snap, step=step, **fields)
            encoded = time.perf_counter()
            store.write(memory_tier.seal(KEY, manifest), buffers)
            done = time.perf_counter()
            results.setdefault("in order, 1 thread (before)", []).append(
                {"seconds": done - started, "read+digest": encoded - started,
                 "write": done - encoded})
            del buffers, snap
            for n in counts:
                step += 1
                started = time.perf_counter()
                _, buffers, times = memory_tier.commit(store, snapshot(), pools[n], n,
                                                       step=step, **fields)
                results.setdefault(f"pipelined, {n} thread{'s' * (n > 1)}", []).append(
                    {"seconds": time.perf_counter() - started, "read": times.read_s,
                     "digest": times.digest_s, "write": times.write_s, "seal": times.seal_s})
                del buffers
    finally:
        reader.shutdown()
        for pool in pools.values():
            pool.shutdown()
        shutil.rmtree(base, ignore_errors=True)
    baseline = statistics.median(r["seconds"] for r in results["in order, 1 thread (before)"])
    summary = {"snapshot_bytes": total, "pieces": len(sizes), "rounds": args.rounds,
               "cpu_count": os.cpu_count(), "arms": {}}
    for name, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        phases = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "seconds"}
        summary["arms"][name] = {"seconds": seconds, "ratio_to_before": seconds / baseline,
                                 "gb_per_s": total / seconds / 1e9, "phases_s": phases}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"commit of {total / 2**30:.2f} GiB in {len(sizes)} pieces, one reader thread, "
          f"{os.cpu_count()} CPUs, median of {args.rounds} rounds")
    for name, arm in summary["arms"].items():
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in arm["phases_s"].items())
        print(f"  {name:30s} {arm['seconds']:6.2f} s  {arm['gb_per_s']:.2f} GB/s  ratio "
              f"{arm['ratio_to_before']:.2f}x of before  ({phases})")


def main() -> None:
    args = parse_args()
    if args.commit_only:
        commit_bench(args)
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    sys.path.insert(0, str(REPO / "trainer_image"))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from tardigrade_checkpoint import memory_tier
    from tardigrade_sdk import replica_server

    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data", None))
    leaves, columns = 8, 1024
    rows = max(args.devices, (args.state_mib << 20) // (4 * columns * leaves))
    rows -= rows % args.devices
    state = {f"w{i}": jax.device_put(jnp.full((rows, columns), i + 1.0, jnp.float32), sharding)
             for i in range(leaves)}

    def make_step(repeats: int) -> Any:
        def step(tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
            def body(_: int, t: dict[str, jax.Array]) -> dict[str, jax.Array]:
                return {k: v * 0.9999 + 1e-4 * jnp.sin(v) for k, v in t.items()}
            return jax.lax.fori_loop(0, repeats, body, tree)
        return jax.jit(step, donate_argnums=0)

    def timed(step: Any, tree: Any, n: int) -> tuple[Any, float]:
        started = time.perf_counter()
        for _ in range(n):
            tree = step(tree)
        jax.block_until_ready(tree)
        return tree, time.perf_counter() - started

    # Calibrate: repeats of the elementwise update that make one step about --step-ms (twice:
    # the first guess comes from a step too short to time well).
    repeats = 1
    for _ in range(2):
        step = make_step(repeats)
        state, _ = timed(step, state, 2)
        state, took = timed(step, state, 5)
        repeats = max(1, round(repeats * args.step_ms / 1000 / (took / 5)))
    step = make_step(repeats)
    state, _ = timed(step, state, 2)

    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(prefix="memory-tier-bench-",
                                 dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))
    own = memory_tier.MemoryStore(base / "own", KEY)
    peer = memory_tier.MemoryStore(base / "peer", KEY)
    if not args.niceness:
        replica_server.lower_priority = lambda: None  # the server's handlers too
    server = replica_server.ReplicaServer(peer, "bench-token", "127.0.0.1", 0, 1 << 40).start()
    address = f"127.0.0.1:{server.port}"
    executor = concurrent.futures.ThreadPoolExecutor(
        1, initializer=replica_server.lower_priority if args.niceness else None)

    from tardigrade_sdk import memory_session

    workers = memory_session.commit_workers()
    pool = concurrent.futures.ThreadPoolExecutor(
        workers, initializer=replica_server.lower_priority if args.niceness else None)

    def commit(number: int, snapshot: memory_tier.Snapshot, replicate: bool) -> float:
        started = time.perf_counter()
        sealed, buffers, _ = memory_tier.commit(own, snapshot, pool, workers, step=number,
                                                attempt=0, owner=0, process_count=2,
                                                lineage="", job_uid="bench")
        if replicate:
            replica_server.send(address, "bench-token", sealed, list(buffers), 0, number)
        return time.perf_counter() - started

    def run(arm: str) -> dict[str, Any]:
        nonlocal state
        pending: concurrent.futures.Future[float] | None = None
        waited, copied, background, skipped = [], [], [], 0
        in_a_row = 0
        jax.block_until_ready(state)
        started = time.perf_counter()
        for number in range(1, args.steps + 1):
            state = step(state)
            if arm != "none" and number % args.interval == 0:
                # The reference loop reads the step's loss before it saves: the step is done.
                jax.block_until_ready(state)
                t0 = time.perf_counter()
                if (arm == "memory, skip" and pending is not None and not pending.done()
                        and in_a_row < memory_session.MAX_SKIPS_IN_A_ROW):
                    skipped += 1  # as memory_session does: the previous commit runs on
                    in_a_row += 1
                    continue
                in_a_row = 0
                if pending is not None:  # the previous snapshot's write and send
                    background.append(pending.result())
                t1 = time.perf_counter()
                snapshot = memory_tier.take_snapshot(state)
                copied.append(time.perf_counter() - t1)
                waited.append(t1 - t0)
                pending = executor.submit(commit, number, snapshot, arm == "memory+replica")
        jax.block_until_ready(state)
        elapsed = time.perf_counter() - started
        if pending is not None:
            background.append(pending.result())
        return {"seconds": elapsed, "steps": args.steps, "copy_s": copied,
                "wait_previous_s": waited, "background_s": background, "skipped": skipped}

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    arms = ("none", "memory", "memory, skip", "memory+replica")
    try:
        runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
        for _ in range(args.rounds):
            for arm in arms:
                runs[arm].append(run(arm))
        results = {arm: {
            "steps_per_s": sum(r["steps"] for r in got) / sum(r["seconds"] for r in got),
            "copy_s_per_snapshot": mean([x for r in got for x in r["copy_s"]]),
            "wait_previous_s_per_snapshot": mean([x for r in got for x in r["wait_previous_s"]]),
            "background_s_per_snapshot": mean([x for r in got for x in r["background_s"]]),
            "snapshots_skipped": sum(r["skipped"] for r in got),
        } for arm, got in runs.items()}
    finally:
        server.stop()
        executor.shutdown()
        pool.shutdown()
        import shutil
        shutil.rmtree(base, ignore_errors=True)
    state_bytes = sum(v.nbytes for v in state.values())
    for arm in results.values():
        arm["ratio_to_none"] = arm["steps_per_s"] / results["none"]["steps_per_s"]
    summary = {"state_mib": round(state_bytes / 2**20, 1), "step_ms": args.step_ms,
               "interval": args.interval, "devices": args.devices, "arms": results}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"state {summary['state_mib']} MiB on {args.devices} CPU devices, step ~"
          f"{args.step_ms:g} ms, memory snapshot every {args.interval} steps")
    for name, arm in results.items():
        print(f"  {name:15s} {arm['steps_per_s']:7.2f} steps/s  ratio {arm['ratio_to_none']:.3f}"
              f"  per snapshot: copy {arm['copy_s_per_snapshot']:.3f} s, waiting for the"
              f" previous {arm['wait_previous_s_per_snapshot']:.3f} s, background"
              f" {arm['background_s_per_snapshot']:.3f} s; skipped"
              f" {arm['snapshots_skipped']}")


if __name__ == "__main__":
    main()
