"""Checkpoints of simulated trainers: one marker file per committed step, no tensors.

Shared by the simulated trainer process (`simtrainer.py`) and the simulated ranks of
simulated nodes (`simulator/simgang.py`), so that both restore the same way.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from tardigrade_contract import contract

CHECKPOINT_PREFIX = "step_"


class MarkerCheckpoints:
    """Committed steps as empty files: `commit` is atomic, like a checkpoint commit."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def committed(self) -> list[int]:
        if not self.root.is_dir():
            return []
        steps = (p.name.removeprefix(CHECKPOINT_PREFIX) for p in self.root.iterdir()
                 if p.name.startswith(CHECKPOINT_PREFIX))
        return sorted(int(s) for s in steps if s.isdigit())

    def path(self, step: int) -> str:
        return str(self.root / f"{CHECKPOINT_PREFIX}{step}")

    def commit(self, step: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        # Unique per writer: every rank commits, and ranks in containers all run as pid 1.
        tmp = self.root / f".{CHECKPOINT_PREFIX}{step}.{uuid.uuid4().hex}"
        tmp.write_text(str(step))
        tmp.replace(self.path(step))


def choose_restore(env: contract.TrainerEnvironment, ckpt: MarkerCheckpoints) -> int | None:
    """The committed step to start from (None: from scratch); raises LookupError."""
    committed = ckpt.committed()
    if env.restore_step == contract.RESTORE_NONE:
        return None
    if env.restore_step == contract.RESTORE_LATEST:
        return committed[-1] if committed else None
    # The operator's pin: the newest committed step, which must be the pin or newer.
    wanted = int(env.restore_step)
    if not committed or committed[-1] < wanted:
        raise LookupError(f"no checkpoint at step {wanted} or newer was committed "
                          f"(have {committed})")
    return committed[-1]
