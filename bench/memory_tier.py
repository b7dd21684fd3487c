"""The memory tier's cost to a training loop's throughput, on the CPU, against no tier.

    python bench/memory_tier.py [--state-mib 256] [--step-ms 100] [--interval 5]
                                [--steps 60] [--devices 4] [--json]

One process stands in for one rank: its state (float32 matrices sharded over --devices CPU
devices) is updated by a jitted step calibrated to take about --step-ms, and three arms run
the same loop in the same process, one after the other:
  * none: no memory tier;
  * memory: every --interval steps the rank's shards are copied off the devices (the loop
    waits for that copy), then a background thread digests them (SHA-256) and commits them to
    a memory directory, as `tardigrade_sdk.memory_session` does;
  * memory+replica: the same, and the snapshot is also sent over loopback HTTP to a replica
    server in this process, which checks it and keeps it (a real rank also receives its
    neighbour's snapshot, so both sides' costs land on the one process, as they do in a gang).
Prints steps per second of each arm and its ratio to `none`, and the loop's blocked seconds
per snapshot (the copy off the devices, and the wait for the previous snapshot's background
work when it outlasts the interval). The memory directory is a tmpfs (/dev/shm) when there
is one, as the pod's emptyDir with medium Memory is.
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
    return parser.parse_args()


def main() -> None:
    args = parse_args()
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

    def commit(number: int, snapshot: memory_tier.Snapshot, replicate: bool) -> float:
        started = time.perf_counter()
        manifest, buffers = memory_tier.encode(snapshot, step=number, attempt=0, owner=0,
                                               process_count=2, lineage="", job_uid="bench")
        sealed = memory_tier.seal(KEY, manifest)
        own.write(sealed, buffers)
        if replicate:
            replica_server.send(address, "bench-token", sealed, list(buffers), 0, number)
        return time.perf_counter() - started

    def run(arm: str) -> dict[str, Any]:
        nonlocal state
        pending: concurrent.futures.Future[float] | None = None
        waited, copied, background = [], [], []
        jax.block_until_ready(state)
        started = time.perf_counter()
        for number in range(1, args.steps + 1):
            state = step(state)
            if arm != "none" and number % args.interval == 0:
                # The reference loop reads the step's loss before it saves: the step is done.
                jax.block_until_ready(state)
                t0 = time.perf_counter()
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
                "wait_previous_s": waited, "background_s": background}

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    arms = ("none", "memory", "memory+replica")
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
        } for arm, got in runs.items()}
    finally:
        server.stop()
        executor.shutdown()
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
              f" {arm['background_s_per_snapshot']:.3f} s")


if __name__ == "__main__":
    main()
