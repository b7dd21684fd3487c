"""Test-only: a user's loop through `TrainingSession` on the CPU taken for an accelerator
whose first save cannot allocate its staged copies (test_staging_budget.py).

    python tests/trainer/staging_loop.py CHECKPOINT_DIR TERMINATION_LOG STEPS INTERVAL

It runs in a process of its own: a session that fails leaves the process (exit_gang), which
would take the test run with it. Its JSON log is on stdout.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tardigrade_checkpoint import snapshot, staging, stagingbudget

GIB = 1 << 30
# What the fake accelerator reports of each device: room for any snapshot of these tests.
FREE_DEVICE = {"bytes_limit": 64 * GIB, "bytes_in_use": 0}


def allocation_failure(nbytes: int) -> jax.errors.JaxRuntimeError:
    """The runtime's error for a device allocation it cannot make."""
    return jax.errors.JaxRuntimeError(
        f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate {nbytes} bytes.")


class FailingFirstCopies:
    """The staging copy program, whose first `fail` calls the device cannot allocate."""

    def __init__(self, fail: int) -> None:
        self.real = staging._programs.copy
        self.fail = fail
        self.calls: list[int] = []

    def __call__(self, xs: list[jax.Array]) -> list[jax.Array]:
        nbytes = sum(int(x.nbytes) for x in xs)
        self.calls.append(nbytes)
        if len(self.calls) <= self.fail:
            raise allocation_failure(nbytes)
        return self.real(xs)


def take_cpu_for_accelerator(setattr: Any, fail: int) -> FailingFirstCopies:
    """`setattr(obj, name, value)` (pytest's monkeypatch, or the builtin): snapshots stage as
    on an accelerator, the devices report `FREE_DEVICE`, and the first `fail` staging copies
    cannot be allocated."""
    setattr(snapshot, "_on_cpu", lambda mine: False)
    setattr(stagingbudget, "device_memory", lambda device: dict(FREE_DEVICE))
    copies = FailingFirstCopies(fail)
    setattr(staging._programs, "copy", copies)
    return copies


def sharded_state(seed: float) -> dict[str, jax.Array]:
    """A state over two devices: one leaf split between them, one replicated."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    rng = np.random.default_rng(int(seed))
    return {"w": jax.device_put(rng.standard_normal((256, 64)).astype(np.float32),
                                NamedSharding(mesh, PartitionSpec("data"))),
            "b": jax.device_put(np.full((64,), seed, np.float32),
                                NamedSharding(mesh, PartitionSpec()))}


def step(state: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return jax.tree.map(lambda x: x * 0.5 + 1.0, state)


def main(checkpoint: str, termination_log: str, steps: int, interval: int) -> None:
    from tardigrade_contract import contract
    from tardigrade_sdk.session import TrainingSession

    take_cpu_for_accelerator(setattr, fail=2)  # both devices of the first save
    env = contract.TrainerEnvironment(
        job_name="staging", namespace="ns", attempt=1, coordinator_address="127.0.0.1:1",
        num_processes=1, process_id=0, checkpoint_path=checkpoint,
        checkpoint_interval_steps=interval, save_on_preemption=False, job_uid="uid-1",
        termination_log=termination_log)
    train = jax.jit(step, donate_argnums=0)
    with TrainingSession(env=env) as session:
        state = session.restore_or(lambda: sharded_state(3.0))
        program = train.lower(state).compile()
        for n in session.steps(steps):
            state = program(state)
            session.prepare_save(state, step_program=program)
            session.end_step(n, state, loss=float(n))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    # As the reference trainer ends (tardigrade_trainer/__main__.py): no interpreter teardown
    # after the session, which once aborted this loop after its "done" under load.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
