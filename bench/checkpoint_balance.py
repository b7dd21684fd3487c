"""Bytes each host writes per checkpoint of the reference model: before and after balancing.

    python bench/checkpoint_balance.py [--devices 16] [--json]

The write plan is a pure function of the global shapes and shardings, so one process with
--devices CPU devices stands in for a gang: host h owns devices [h*D/H, (h+1)*D/H). For 2, 4
and 8 hosts, with pure data parallelism and with a model axis of 2 inside each host, prints
each host's share of the bytes as max/even and min/even, and the objects (chunks) written:
  * before: the writer of each distinct shard picked by CRC32 of the leaf name and region
    (how manager.py chose until the balanced plan), replicated shards written whole;
  * after: `checkpoint/writers.py` (replicated shards split into pieces, largest first to
    the least-loaded host holding them).
Target: every host within 1.25x of an even share (max/even <= 1.25) after balancing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import zlib
from pathlib import Path
from typing import Any

TARGET = 1.25


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=16, help="CPU devices in the gang")
    parser.add_argument("--seq-len", type=int, default=32,
                        help="reference model sequence length (examples/trainingjob.yaml)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    return parser.parse_args()


def crc32_plan(name: str, leaf: Any, process_of: Any) -> list[tuple[int, Any]]:
    """(bytes, device) written per distinct shard by the CRC32 choice (the "before" arm)."""
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
        key = tuple((s.start, s.stop, s.step) for s in index)
        groups.setdefault(key, []).append(device)
    shard_bytes = math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    chosen = []
    for key, devices in groups.items():
        devices.sort(key=lambda d: (process_of(d), d.id))
        by_process: dict[int, Any] = {}
        for device in devices:
            by_process.setdefault(process_of(device), device)
        candidates = list(by_process.values())
        chosen.append((shard_bytes, candidates[zlib.crc32(f"{name}{key}".encode())
                                               % len(candidates)]))
    return chosen


def reference_state(hosts: int, model_axis: int, seq_len: int) -> tuple[list[str], list[Any]]:
    import equinox as eqx
    import jax
    from tardigrade_checkpoint.manager import leaf_names
    from tardigrade_trainer import mesh, model, train
    from tardigrade_trainer.config import TrainerConfig

    config = TrainerConfig(seq_len=seq_len, model_axis_size=model_axis,
                           global_batch_size=len(jax.devices()))
    optimizer = train.make_optimizer(config)

    def init(key: jax.Array) -> dict[str, Any]:
        gpt = model.Gpt.init(config, key=key)
        return {"model": gpt, "opt": optimizer.init(eqx.filter(gpt, eqx.is_array))}

    plan = mesh.build_mesh(config)
    target = train.abstract_target(eqx.filter_eval_shape(init, jax.random.PRNGKey(0)), plan)
    return leaf_names(target), jax.tree_util.tree_leaves(target)


def measure(hosts: int, model_axis: int, seq_len: int) -> dict[str, Any]:
    import jax
    from tardigrade_checkpoint import writers

    per_host = len(jax.devices()) // hosts

    def process_of(device: Any) -> int:
        return int(device.id) // per_host

    names, leaves = reference_state(hosts, model_axis, seq_len)
    total = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in leaves)
    before = dict.fromkeys(range(hosts), 0)
    objects_before = 0
    for name, leaf in zip(names, leaves, strict=True):
        for nbytes, device in crc32_plan(name, leaf, process_of):
            before[process_of(device)] += nbytes
            objects_before += 1
    plans = writers.plan([writers.layout(n, leaf) for n, leaf in zip(names, leaves, strict=True)],
                         process_of)
    after = writers.bytes_per_host(
        plans, {n: leaf.dtype.itemsize for n, leaf in zip(names, leaves, strict=True)},
        process_of)
    after = {h: after.get(h, 0) for h in range(hosts)}
    even = total / hosts
    return {
        "hosts": hosts, "model_axis": model_axis, "leaves": len(leaves), "bytes": total,
        "before": {"max_even": max(before.values()) / even,
                   "min_even": min(before.values()) / even, "objects": objects_before,
                   "bytes_per_host": [before[h] for h in range(hosts)]},
        "after": {"max_even": max(after.values()) / even,
                  "min_even": min(after.values()) / even,
                  "objects": sum(len(p.writes) for p in plans.values()),
                  "bytes_per_host": [after[h] for h in range(hosts)]},
    }


def main() -> int:
    args = parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_image"))
    rows = [measure(hosts, model_axis, args.seq_len)
            for model_axis in (1, 2) for hosts in (2, 4, 8)
            if args.devices % hosts == 0 and (args.devices // hosts) % model_axis == 0]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"reference model (TrainerConfig defaults, seq_len {args.seq_len}): "
          f"{rows[0]['leaves']} leaves, {rows[0]['bytes']} bytes; {args.devices} CPU devices")
    print("hosts model-axis | before: max/even min/even objects | after: max/even min/even "
          "objects | target")
    for row in rows:
        b, a = row["before"], row["after"]
        verdict = "met" if a["max_even"] <= TARGET else "MISSED"
        print(f"{row['hosts']:5d} {row['model_axis']:10d} | {b['max_even']:7.2f}x "
              f"{b['min_even']:8.2f}x {b['objects']:7d} | {a['max_even']:6.2f}x "
              f"{a['min_even']:8.2f}x {a['objects']:7d} | <= {TARGET}x {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
