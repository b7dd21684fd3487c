"""The name of the trainer's cached step, known before the step is traced, and its load started
from the moment the devices are open.

A relaunch's first step waits for its cached step's load (seconds on an accelerator: about 7 s
for the 184M reference step on a TPU v5e chip). The entry is named by what determines the
program (step_cache.identity_key): the process's facts, this package's source, the libraries'
versions, the configuration and the step's donated arguments. None of that needs the trainer's
own modules (haliax, equinox, optax: seconds of imports, which on a TPU host could end a second
after the chip opened), so a process of one gang member starts the load from `__main__` once
the devices are up (`EarlyPreload`), and the trainer adopts it where it names the same entry
for the same devices.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tardigrade_trainer import step_cache
from tardigrade_trainer.config import TrainerConfig

log = logging.getLogger(__name__)

# The training step's donated arguments: its state, not its batch.
DONATE = (True, False, False)


def preload_key(config: TrainerConfig, devices: Sequence[Any]) -> str:
    """The step-cache entry's name for the step of `config` on `devices` (in the mesh's
    order), without tracing it."""
    identity = {
        "trainer": step_cache.source_digest(Path(__file__).resolve().parent),
        "libraries": step_cache.library_versions("marin-haliax", "haliax", "equinox",
                                                 "optax"),
        "config": dataclasses.asdict(config),
        "donate": DONATE,
        # What JAX and libtpu read from the environment may change the program (XLA_FLAGS
        # is one of the process's facts); their logging and cache settings do not.
        "environment": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith(("JAX_", "LIBTPU_"))
                        and "LOG" not in k and "CACHE" not in k},
    }
    return step_cache.identity_key(step_cache.program_facts(devices), identity)


class EarlyPreload:
    """In a thread: once the devices are open, the step's entry read and loaded onto them in
    the mesh's device order (step_cache.Preload). `preload(key, devices)` gives that load to
    the trainer where it is the one it wants; anything that went wrong here leaves the
    trainer to start its own."""

    def __init__(self, cache_folder: str | Path, config: TrainerConfig) -> None:
        self._decided = threading.Event()
        self._preload: step_cache.Preload | None = None
        self._devices: list[Any] = []

        def run() -> None:
            try:
                import jax

                from tardigrade_trainer import mesh

                # Waits for the devices (opened by the thread distributed.open_devices_early
                # started).
                self._devices = mesh.device_order(config, jax.devices())
                cache = step_cache.StepCache(cache_folder, jax.process_index())
                self._preload = step_cache.Preload(cache, preload_key(config, self._devices),
                                                   self._devices)
            except Exception:  # the trainer's own start raises it again, where it counts
                log.debug("the step's early preload did not start", exc_info=True)
            finally:
                self._decided.set()

        threading.Thread(target=run, name="early-preload", daemon=True).start()

    def preload(self, key: str, devices: Sequence[Any]) -> step_cache.Preload | None:
        """The load started here, if it is of entry `key` onto `devices` (in that order)."""
        self._decided.wait()
        found = self._preload
        if found is None or found.key != key or self._devices != list(devices):
            return None
        return found

    def wait(self) -> None:
        """Until the load started here (if any) is done: an interpreter that exits while XLA
        loads in another thread may abort."""
        self._decided.wait()
        if self._preload is not None:
            self._preload.wait()
