"""The reference loop compiles its step once, ahead of time and while the state is restored,
and then runs that executable: the step's first call compiles nothing again."""

from __future__ import annotations

import hashlib
import signal

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tardigrade_contract import contract
from tardigrade_trainer import compile_cache
from tardigrade_trainer.compiled_step import CompiledStep, lower_abstract
from tardigrade_trainer.step_cache import StepCache
from trainer_harness import launch, wait_for

Batch = hax.Axis("batch", 4)
Embed = hax.Axis("embed", 8)


def _step(state, x):
    w = state["w"] * 0.5 + hax.dot(x, state["v"], axis=Embed).sum().array
    return {"w": w, "v": state["v"] + 1.0, "tag": state["tag"]}, (x * 2).sum().array


def _setup():
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    mapping = {"batch": "data"}
    sharding = NamedSharding(mesh, PartitionSpec())
    state = {"w": jax.device_put(jnp.ones(3), sharding),
             "v": hax.named(jax.device_put(jnp.arange(8.0), sharding), Embed),
             "tag": "static"}
    x = hax.named(jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, PartitionSpec("data"))),
                  (Batch, Embed))
    return mesh, mapping, state, x


def _abstract(tree):
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        if isinstance(a, jax.Array) else a, tree)


def test_lowering_for_abstract_state_is_the_named_jit_program_and_runs_on_real_state():
    mesh, mapping, state, x = _setup()
    donate = (True, False)
    with jax.set_mesh(mesh), hax.axis_mapping(mapping):
        jitted = hax.named_jit(_step, axis_resources=mapping, donate_args=donate)
        real = jitted.lower(state, x)
        abstract = lower_abstract(_step, donate, mapping, _abstract(state), x)
        # The same program: JAX's cache serves one for the other.
        assert abstract.as_text() == real.as_text()
        expected_state, expected_out = jitted(_setup()[2], x)
        call = CompiledStep(_step, abstract.compile(), donate, (_abstract(state), x))
        new_state, out = call(state, x)
        assert new_state["tag"] == "static"
        np.testing.assert_array_equal(new_state["w"], expected_state["w"])
        np.testing.assert_array_equal(new_state["v"].array, expected_state["v"].array)
        assert float(out) == float(expected_out)
        again, _ = call(new_state, x)  # the loop feeds the step its own output
    np.testing.assert_array_equal(again["v"].array, expected_state["v"].array + 1.0)


def _train_step_compiles(gang) -> int:
    return gang.stderr(0).read_text().count("Finished XLA compilation of jit(_train_step)")


def _preempted_after(gang, steps: int) -> None:
    """SIGTERM once `steps` steps are logged: the rank saves on notice and exits 75."""
    wait_for(lambda: len(gang.events("step")) >= steps, 180, f"{steps} training steps")
    gang.signal(signal.SIGTERM)
    assert gang.wait() == [contract.EXIT_PREEMPTED_SAVED], gang.describe()


@pytest.mark.slow
def test_the_loop_runs_the_step_it_compiled_and_a_relaunch_compiles_none(tmp_path):
    ckpt = tmp_path / "ckpt"
    # One job, launched twice (the same config: the same program).
    config = {"steps": 100000, "compilation_cache_dir": str(tmp_path / "cache")}
    logs = {"JAX_LOG_COMPILES": "1"}
    first = launch(tmp_path / "first", processes=1, checkpoint_path=str(ckpt), config=config,
                   extra_env=logs)
    _preempted_after(first, 3)
    # Compiled once, before the first step; the first step's call compiled nothing more.
    assert _train_step_compiles(first) == 1, first.describe()
    assert first.events("compiled")[0]["step_cache"] == "miss"
    saved = first.events("preempted")[0]["step"]

    relaunch = launch(tmp_path / "second", processes=1, checkpoint_path=str(ckpt),
                      config=config, extra_env=logs)
    _preempted_after(relaunch, 2)
    assert relaunch.events("restore_done")[0]["step"] == saved
    assert min(relaunch.losses()) == saved + 1
    assert _train_step_compiles(relaunch) == 0, relaunch.describe()
    compiled = relaunch.events("compiled")[0]
    # Run before it was traced, then checked beside the loop: the program it holds is the one
    # this code lowers.
    assert compiled["step_cache"] == "hit" and compiled["step_untraced"] is True
    # Its load started from `__main__` as the devices opened, and the trainer took it over.
    assert compiled["step_preloaded_early"] is True
    assert [e["matches"] for e in relaunch.events("step_checked")] == [True], relaunch.describe()


@pytest.mark.slow
def test_a_step_whose_stored_program_differs_is_found_by_the_check_and_replaced(tmp_path):
    """What the key cannot see (here: the entry's record of its program, rewritten) the late
    check does: the loop swaps to the step compiled from the program lowered now, stores it,
    and the next relaunch's check finds the two agree."""
    ckpt = tmp_path / "ckpt"
    config = {"steps": 100000, "compilation_cache_dir": str(tmp_path / "cache")}
    _preempted_after(launch(tmp_path / "first", processes=1, checkpoint_path=str(ckpt),
                            config=config), 2)
    copy = compile_cache.location(config["compilation_cache_dir"], "")
    assert copy is not None
    (entry,) = StepCache(copy.local, rank=0).entries()
    key = entry.name.removesuffix(".step")
    payload = bytearray(StepCache(copy.local, rank=0).read(key))
    payload[:32] = hashlib.sha256(b"another program").digest()
    StepCache(copy.local, rank=0).write(key, bytes(payload))

    changed = launch(tmp_path / "second", processes=1, checkpoint_path=str(ckpt), config=config)
    wait_for(lambda: changed.events("step_checked"), 180, "the step's check")
    _preempted_after(changed, len(changed.events("step")) + 2)
    assert changed.events("compiled")[0]["step_untraced"] is True
    (checked,) = changed.events("step_checked")
    assert checked["matches"] is False and "compiled again" in checked["detail"]
    losses = changed.losses()
    assert sorted(losses) == list(range(min(losses), max(losses) + 1))  # no step skipped

    again = launch(tmp_path / "third", processes=1, checkpoint_path=str(ckpt), config=config)
    wait_for(lambda: again.events("step_checked"), 180, "the step's check")
    _preempted_after(again, len(again.events("step")) + 1)
    assert [e["matches"] for e in again.events("step_checked")] == [True], again.describe()


@pytest.mark.slow
def test_a_relaunch_with_nothing_left_to_train_exits_cleanly(tmp_path):
    # The step compiles in a thread while the state is restored: a process that exited while
    # XLA compiled there would abort (SIGABRT) instead of saying Succeeded.
    ckpt = tmp_path / "ckpt"
    done = launch(tmp_path / "first", processes=1, checkpoint_path=str(ckpt),
                  config={"steps": 3})
    assert done.wait() == [0], done.describe()
    again = launch(tmp_path / "again", processes=1, checkpoint_path=str(ckpt),
                   config={"steps": 3})
    assert again.wait() == [0], again.describe()
    assert again.events("restore_done")[0]["step"] == 3
    assert again.events("step") == [] and again.termination(0).reason == "Succeeded"
