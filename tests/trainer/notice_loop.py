"""Test-only: a user's loop through `TrainingSession` held where a test sends it a notice
(test_notice_phases.py).

    python tests/trainer/notice_loop.py MODE MARKER_DIR

MODE `evaluate`: after step 5 an evaluation that never ends by itself (each of its batches
calls `session.check_notice(state)`); marker `evaluating-<process>`. MODE `in_flight`: one
save, of step 4, held on process 0 after its writes (injected_faults.py `hold`, released by
the test), while training goes on; marker `after_write-4-0`. No other save is due: the
operator's interval is unset.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.*

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec
from tardigrade_sdk.session import TrainingSession

from tests.trainer.injected_faults import ScriptedFaults

optimizer = optax.adam(0.05)


@jax.jit
def train_step(state, step):
    x = jax.random.normal(jax.random.PRNGKey(step), (64, 4))
    y = x @ jnp.array([1.0, -2.0, 3.0, 0.5]) + 1.0

    def loss_fn(params):
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = optimizer.update(grads, state["opt"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


@jax.jit
def evaluate(params, batch):
    x = jax.random.normal(jax.random.PRNGKey(1_000_000 + batch), (64, 4))
    return jnp.mean(x @ params["w"] + params["b"])


mode, marker_dir = sys.argv[1], Path(sys.argv[2])
hooks = ([{"point": "after_write", "step": 4, "process": 0, "action": "hold"}]
         if mode == "in_flight" else [])
with TrainingSession(faults=ScriptedFaults(hooks, marker_dir)) as session:
    mesh = jax.make_mesh((jax.device_count(),), ("data",))

    @partial(jax.jit, out_shardings=NamedSharding(mesh, PartitionSpec()))
    def init():
        params = {"w": jnp.zeros(4), "b": jnp.zeros(())}
        return {"params": params, "opt": optimizer.init(params)}

    state = session.restore_or(init)
    for step in session.steps(1_000_000):
        state, loss = train_step(state, step)
        session.end_step(step, state, loss=loss)
        if mode == "in_flight" and step == 4:
            session.save(step, state, "interval")
        if mode == "evaluate" and step == 5:
            (marker_dir / f"evaluating-{jax.process_index()}").write_text("")
            batch = 0
            while True:  # longer than any shutdown window
                session.check_notice(state)
                evaluate(state["params"], batch).block_until_ready()
                batch += 1
