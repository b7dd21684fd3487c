"""A gang whose hosts each see their own checkpoint root (an emptyDir or hostPath per node).

Without the start-up probe such a gang trains and "commits" checkpoints that no later gang can
restore: process 0's commit marker sits beside its own shards only. The trial passes when the
trainer refuses to start instead: every host exits with the config error, nothing is written
but what the writability check leaves, and no probe file is left behind.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tardigrade_contract import contract

from tests.trainer.trainer_harness import launch, step_dirs


def unshared_root_is_refused(workdir: Path, config: dict[str, Any]) -> tuple[bool, str, float]:
    """(ok, what happened, seconds) for a 2-process gang with one root per host."""
    started = time.monotonic()
    roots = [workdir / "node-a" / "ckpt", workdir / "node-b" / "ckpt"]
    gang = launch(workdir / "gang", processes=2, checkpoint_path=str(roots[0]), config=config,
                  interval_steps=2, init_timeout=300,  # a loaded machine starts jax slowly
                  rank_env={1: {contract.ENV_CHECKPOINT_PATH: str(roots[1])}})
    codes = gang.wait(timeout=420)
    messages = [gang.termination(rank) for rank in (0, 1)]
    leftovers = [p.name for root in roots if root.exists() for p in root.iterdir()]
    problems = []
    if codes != [contract.EXIT_CONFIG_ERROR] * 2:
        problems.append(f"exit codes {codes}, want {contract.EXIT_CONFIG_ERROR} on both hosts")
    for rank, message in enumerate(messages):
        if message is None or "is not shared between hosts" not in message.message:
            problems.append(f"rank {rank} termination message: {message}")
    if gang.events("step") or any(step_dirs(root) for root in roots if root.exists()):
        problems.append("the gang trained or saved before refusing the root")
    if leftovers:
        problems.append(f"left under the roots: {leftovers}")
    seconds = time.monotonic() - started
    if problems:
        return False, "; ".join(problems) + "\n" + gang.describe()[-2000:], seconds
    return True, f"both hosts exit {codes[0]} (ConfigError) before training; nothing left", seconds
