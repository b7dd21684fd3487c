"""The floor under a relaunch on this machine: a program that does nothing but open the chip
and load the training step that a relaunch loads.

    python bench/chip_floor.py [--step-cache DIR]

Prints one JSON line: seconds from the process's start (as the kernel records it, the clock of
the trainer's `startup` event) to `import jax` done and to the devices open; with
`--step-cache` (a pod's local copy of the compilation cache holding the trainer's step cache,
rank 0: the shared folder's entries are sealed, compile_cache.py), the
seconds its newest entry takes to read and to load onto the devices, and its size. No relaunch
can reach its first step before both: whatever `bench/chip.py` measures above their sum is the
trainer's own start-up (imports, the restore, tracing the step, waiting on each other).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "trainer_image"))

from tardigrade_sdk import phases  # noqa: E402  (dependency-free: no jax yet)


def load_step(folder: Path) -> dict[str, float | int | str]:
    import jax
    from tardigrade_trainer import step_cache
    from tardigrade_trainer.step_cache import StepCache

    cache = StepCache(folder, rank=0)
    entries = cache.entries()
    if not entries:
        return {"step_load": f"no entry in {cache.folder}"}
    started = time.perf_counter()
    payload = cache.read(entries[0].name.removesuffix(".step"))
    assert payload is not None
    read_s = time.perf_counter() - started
    # What the trainer's preload does (the executable on the device, before the argument
    # trees it needs only to wrap it are known).
    step_cache._load(payload, jax.devices())
    return {"step_read_s": round(read_s, 3),
            "step_load_s": round(time.perf_counter() - started - read_s, 3),
            "step_entry_bytes": len(payload)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-cache", type=Path,
                        help="a local copy of the compilation cache, with the trainer's step cache")
    args = parser.parse_args()
    zero = phases.process_started() or time.time()
    import jax

    found: dict[str, float | int | str] = {"jax_imported_s": round(time.time() - zero, 3)}
    devices = jax.devices()
    found["devices_open_s"] = round(time.time() - zero, 3)
    found["devices"] = f"{len(devices)} x {devices[0].device_kind}"
    if args.step_cache is not None:
        found.update(load_step(args.step_cache))
        found["step_loaded_s"] = round(time.time() - zero, 3)
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
