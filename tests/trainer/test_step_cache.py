"""The per-rank cache of the compiled step (step_cache.py) and the step that calls what it holds
(compiled_step.py), in one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tardigrade_trainer import compiled_step, step_cache, step_check
from tardigrade_trainer.compiled_step import CompiledStep
from tardigrade_trainer.step_cache import CorruptEntryError, StepCache, compile_or_load, entry_key

FACTS = {"jax": "0.10.2", "jaxlib": "0.10.2", "platform": "cpu", "platform_version": "cpu",
         "process_index": 1, "process_count": 2,
         "devices": [[0, 0, "cpu"], [1, 0, "cpu"], [2, 1, "cpu"], [3, 1, "cpu"]],
         "xla_flags": "--xla_force_host_platform_device_count=2"}
PROGRAM = "module @jit_step { func.func public @main() { return } }"


pytestmark = pytest.mark.usefixtures("without_jax_persistent_cache")


def test_the_key_is_the_same_for_the_same_program_and_process():
    assert entry_key(PROGRAM, FACTS) == entry_key(PROGRAM, dict(reversed(FACTS.items())))


@pytest.mark.parametrize("change", [
    {"process_count": 3},  # world size
    {"process_index": 0},  # rank
    {"devices": [[0, 0, "cpu"], [1, 0, "cpu"], [3, 1, "cpu"], [2, 1, "cpu"]]},  # device order
    {"xla_flags": ""},
    {"jaxlib": "0.10.3"},
    {"platform_version": "cuda 12.9"},
], ids=lambda change: next(iter(change)))
def test_the_key_changes_with_what_makes_an_executable_valid(change):
    assert entry_key(PROGRAM, {**FACTS, **change}) != entry_key(PROGRAM, FACTS)


def test_the_key_changes_with_the_program():
    assert entry_key(PROGRAM.replace("main", "main2"), FACTS) != entry_key(PROGRAM, FACTS)


def test_the_facts_are_this_processs(monkeypatch):
    # The backend first, under the suite's flags (tests/conftest.py): started under these it
    # would give the later tests of this worker one device instead of four.
    devices = jax.devices()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
    facts = step_cache.program_facts(devices)
    assert facts["process_index"] == 0 and facts["process_count"] == 1
    assert facts["jax"] == jax.__version__ and facts["platform"] == "cpu"
    assert facts["devices"] == [[d.id, 0, d.device_kind] for d in devices]
    assert facts["xla_flags"] == "--xla_cpu_use_thunk_runtime=true"


def test_a_write_is_whole_or_nothing(tmp_path, monkeypatch):
    cache = StepCache(tmp_path, rank=1)
    cache.write("a" * 64, b"first")

    def torn(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(step_cache.os, "replace", torn)
    with pytest.raises(OSError, match="disk full"):
        cache.write("a" * 64, b"second, never renamed")
    assert cache.read("a" * 64) == b"first"
    assert sorted(p.name for p in cache.folder.iterdir()) == ["a" * 64 + ".step"]


def test_each_rank_has_its_own_folder_next_to_jaxs_cache(tmp_path):
    StepCache(tmp_path, rank=0).write("k", b"rank 0's")
    StepCache(tmp_path, rank=1).write("k", b"rank 1's")
    assert StepCache(tmp_path, rank=1).read("k") == b"rank 1's"
    assert StepCache(tmp_path, rank=1).folder == tmp_path / "tardigrade-step-cache" / "rank-1"


def test_the_cache_keeps_the_entries_used_last(tmp_path):
    cache = StepCache(tmp_path, rank=0, keep=2)
    for i, key in enumerate(("first", "second")):
        cache.write(key, key.encode())
        os.utime(cache.path(key), (1000.0 + i, 1000.0 + i))
    # Reading "first" makes it the most recently used: the next write evicts "second".
    assert cache.read("first") == b"first"
    cache.write("third", b"third")
    assert [p.stem for p in cache.entries()] == ["third", "first"]
    with pytest.raises(ValueError, match="keep at least 1"):
        StepCache(tmp_path, rank=0, keep=0)


def test_a_corrupt_entry_is_refused_before_it_is_loaded(tmp_path):
    cache = StepCache(tmp_path, rank=0)
    cache.write("k", b"payload")
    data = bytearray(cache.path("k").read_bytes())
    data[-1] ^= 1
    cache.path("k").write_bytes(bytes(data))
    with pytest.raises(CorruptEntryError, match="digest mismatch"):
        cache.read("k")
    cache.path("k").write_bytes(b"half")
    with pytest.raises(CorruptEntryError, match="not a step cache entry"):
        cache.read("k")


def _lowered_example():
    x = jnp.arange(8.0)
    return jax.jit(lambda v: jnp.sin(v) * 2.0 + 1.0).lower(x), x


def test_a_second_compile_loads_the_stored_step(tmp_path):
    cache = StepCache(tmp_path, rank=0)
    lowered, x = _lowered_example()
    compiled, first = compile_or_load(lowered, cache, jax.devices()[:1])
    assert first.result == "miss" and first.detail is None
    assert len(cache.entries()) == 1
    loaded, second = compile_or_load(lowered, cache, jax.devices()[:1])
    assert second.result == "hit"
    np.testing.assert_array_equal(loaded(x), compiled(x))
    assert second.fields()["step_cache"] == "hit" and "step_cache_detail" not in second.fields()


@pytest.mark.parametrize("cached", [False, True])
def test_the_backend_hook_runs_once_after_the_python_side(tmp_path, cached, monkeypatch):
    """`on_backend` tells the trainer the GIL is free for its restore: once per call, after
    the key is computed and before the executable is loaded or compiled."""
    cache = StepCache(tmp_path, rank=0) if cached else None
    lowered, x = _lowered_example()
    if cached:
        compile_or_load(lowered, cache, jax.devices()[:1])  # now a hit
    calls: list[str] = []
    hooked = step_cache.entry_key
    monkeypatch.setattr(step_cache, "entry_key",
                        lambda *args: (calls.append("key"), hooked(*args))[1])
    compiled, outcome = compile_or_load(lowered, cache, jax.devices()[:1],
                                        on_backend=lambda: calls.append("backend"))
    assert outcome.result == ("hit" if cached else "off")
    assert calls == (["key", "backend"] if cached else ["backend"])
    np.testing.assert_allclose(compiled(x), np.sin(np.arange(8.0)) * 2.0 + 1.0, rtol=1e-6)


@pytest.mark.parametrize("damage", ["flipped byte", "valid digest, not an executable"])
def test_an_entry_that_does_not_load_falls_back_to_compiling(tmp_path, damage):
    cache = StepCache(tmp_path, rank=0)
    lowered, x = _lowered_example()
    expected = np.asarray(compile_or_load(lowered, cache, jax.devices()[:1])[0](x))
    (path,) = cache.entries()
    if damage == "flipped byte":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        cache.write(path.stem, b"\x80\x05 not a pickled executable")
    compiled, outcome = compile_or_load(lowered, cache, jax.devices()[:1])
    assert outcome.result == "fallback"
    assert "did not load" in outcome.detail and "compiled instead" in outcome.detail
    np.testing.assert_array_equal(compiled(x), expected)
    # The bad entry was replaced by a good one.
    assert compile_or_load(lowered, cache, jax.devices()[:1])[1].result == "hit"


def test_without_a_folder_the_step_is_compiled(tmp_path):
    lowered, x = _lowered_example()
    compiled, outcome = compile_or_load(lowered, None, jax.devices()[:1])
    assert outcome.result == "off"
    np.testing.assert_allclose(compiled(x), np.sin(np.arange(8.0)) * 2.0 + 1.0, rtol=1e-6)
    assert not list(Path(tmp_path).iterdir())


def _named_step():
    Batch = hax.Axis("batch", 4)

    def step(state, x):
        return {"w": state["w"] * 0.5 + x.sum().array, "tag": state["tag"]}, (x * 2).sum()

    state = {"w": jnp.ones(3), "tag": "kept static"}
    x = hax.named(jnp.arange(4.0), Batch)
    return step, state, x


def test_the_compiled_step_is_called_like_the_named_jit_step(tmp_path):
    step, state, x = _named_step()
    donate = (True, False)
    jitted = hax.named_jit(step, donate_args=donate)
    expected_state, expected_out = jitted({"w": jnp.ones(3), "tag": "kept static"}, x)
    lowered = jitted.lower(state, x)
    assert compile_or_load(lowered, StepCache(tmp_path, rank=0), jax.devices()[:1])[1].result \
        == "miss"
    loaded, outcome = compile_or_load(lowered, StepCache(tmp_path, rank=0), jax.devices()[:1])
    assert outcome.result == "hit"
    call = CompiledStep(step, loaded, donate, (state, x))
    new_state, out = call(state, x)
    assert new_state["tag"] == "kept static"
    np.testing.assert_array_equal(new_state["w"], expected_state["w"])
    assert float(out) == float(expected_out)
    # The loop feeds the step its own output.
    again, _ = call(new_state, x)
    np.testing.assert_array_equal(again["w"], expected_state["w"] * 0.5 + 6.0)
    with pytest.raises(ValueError, match="another structure"):
        call({"w": jnp.ones(3), "tag": "another static"}, x)


# Run in a process of its own: JAX reads its persistent cache's settings once per process.
_ONE_PROCESS = """
import sys
import jax, jax.numpy as jnp
from tardigrade_sdk import distributed
from tardigrade_trainer.step_cache import StepCache, compile_or_load

distributed.configure_compilation_cache(sys.argv[1])
x = jnp.linspace(0.0, 1.0, 64).reshape(8, 8)
step = jax.jit(lambda v: jnp.where(v > 0.5, jnp.tanh(v) * 3.0, v.sum() + v))
compiled, outcome = compile_or_load(step.lower(x), StepCache(sys.argv[2], rank=0),
                                    jax.devices()[:1])
print(outcome.result, float(compiled(x).sum()))
"""


def _in_a_process(jax_cache: Path, step_cache_root: Path) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", _ONE_PROCESS, str(jax_cache),
                          str(step_cache_root)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result, total = out.stdout.split()
    return result, float(total)


def test_a_step_jax_loaded_from_its_own_cache_is_not_stored(tmp_path):
    # Serialized again, such a step lacks its CPU object code and fails when run
    # ("NOT_FOUND: Function ... not found"): it must never become an entry.
    first = _in_a_process(tmp_path / "jax", tmp_path / "steps")
    assert first[0] == "miss"
    served = _in_a_process(tmp_path / "jax", tmp_path / "other-steps")
    assert served == ("jax_cache", first[1])
    assert not StepCache(tmp_path / "other-steps", rank=0).entries()
    assert _in_a_process(tmp_path / "jax", tmp_path / "steps") == ("hit", first[1])


def test_a_step_named_without_tracing_is_loaded_before_the_lowering_and_used_once_it_matches(
        tmp_path):
    """A relaunch starts loading its entry before it traces the step (Preload); the loaded
    executable is used once the lowering shows it holds the same program."""
    cache = StepCache(tmp_path, rank=0)
    devices = jax.devices()[:1]
    key = step_cache.identity_key(step_cache.program_facts(devices), {"config": {"lr": 1}})
    step, state, x = _named_step()
    lowered = hax.named_jit(step, donate_args=(True, False)).lower(state, x)
    compiled, first = compile_or_load(lowered, cache, devices, key=key,
                                      preload=step_cache.Preload(cache, key, devices))
    assert first.result == "miss" and [p.stem for p in cache.entries()] == [key]
    expected = CompiledStep(step, compiled, (True, False), (state, x))(
        {"w": jnp.ones(3), "tag": "kept static"}, x)
    preload = step_cache.Preload(cache, key, devices)
    got = preload.result()  # loaded with nothing traced or lowered in this call
    assert got.loaded is not None and got.found
    loaded, second = compile_or_load(lowered, cache, devices, key=key, preload=preload)
    assert second.result == "hit" and second.detail is None
    new_state, out = CompiledStep(step, loaded, (True, False), (state, x))(
        {"w": jnp.ones(3), "tag": "kept static"}, x)
    np.testing.assert_array_equal(new_state["w"], expected[0]["w"])
    assert new_state["tag"] == "kept static" and float(out) == float(expected[1])


def test_an_entry_named_without_tracing_that_holds_another_program_is_never_run(tmp_path):
    """The key says nothing of what it does not cover (a library's behaviour, an environment
    variable): an entry stored for another program under the same key is compiled over, and
    the step computes what the program lowered now says."""
    cache = StepCache(tmp_path, rank=0)
    devices = jax.devices()[:1]
    key = step_cache.identity_key(step_cache.program_facts(devices), {"config": {"lr": 1}})
    x = jnp.arange(8.0)
    old = jax.jit(lambda v: jnp.sin(v) * 2.0 + 1.0).lower(x)
    assert compile_or_load(old, cache, devices, key=key)[1].result == "miss"
    new = jax.jit(lambda v: jnp.cos(v) - 3.0).lower(x)
    compiled, outcome = compile_or_load(new, cache, devices, key=key,
                                        preload=step_cache.Preload(cache, key, devices))
    assert outcome.result == "fallback" and "another program" in outcome.detail
    np.testing.assert_allclose(compiled(x), np.cos(np.arange(8.0)) - 3.0, rtol=1e-6)
    # Stored again for the program it now holds: the next relaunch loads it.
    again, outcome = compile_or_load(new, cache, devices, key=key,
                                     preload=step_cache.Preload(cache, key, devices))
    assert outcome.result == "hit"
    np.testing.assert_allclose(again(x), np.cos(np.arange(8.0)) - 3.0, rtol=1e-6)


def test_the_key_named_without_tracing_follows_the_source_and_the_configuration(tmp_path):
    facts = step_cache.program_facts(jax.devices()[:1])
    (tmp_path / "model.py").write_text("LAYERS = 2\n")
    before = step_cache.source_digest(tmp_path)
    base = {"trainer": before, "config": {"embed_dim": 32}}
    assert step_cache.identity_key(facts, base) == step_cache.identity_key(facts, dict(base))
    assert step_cache.identity_key(facts, base) != step_cache.identity_key(
        facts, {**base, "config": {"embed_dim": 64}})
    (tmp_path / "model.py").write_text("LAYERS = 3\n")
    assert step_cache.source_digest(tmp_path) != before
    assert step_cache.identity_key(facts, base) != step_cache.identity_key(
        {**facts, "process_index": 1}, base)


def _predicted(step, state, x, donate):
    # The step returns its state and a NamedArray without axes.
    loss = hax.NamedArray(jax.ShapeDtypeStruct((), jnp.float32), ())
    return compiled_step.predicted_trees(step, donate, (state, x), (state, loss))


def test_trees_worked_out_without_tracing_wrap_a_loaded_step_where_the_lowering_agreed(tmp_path):
    """A relaunch may run its entry before it traces the step: the entry says whether the
    argument and output trees its caller predicts were the lowering's, and wrapped in them the
    loaded executable computes what the named_jit step does."""
    cache = StepCache(tmp_path, rank=0)
    devices = jax.devices()[:1]
    key = step_cache.identity_key(step_cache.program_facts(devices), {"config": {"lr": 1}})
    step, state, x = _named_step()
    donate = (True, False)
    jitted = hax.named_jit(step, donate_args=donate)
    expected_state, expected_out = jitted({"w": jnp.ones(3), "tag": "kept static"}, x)
    predicted = _predicted(step, state, x, donate)
    assert compile_or_load(jitted.lower(state, x), cache, devices, key=key,
                           predicted=predicted)[1].result == "miss"

    loaded = step_cache.Preload(cache, key, devices).result().loaded
    assert loaded is not None and loaded.trees_predicted
    call = CompiledStep(step, loaded.compiled_with(*predicted), donate, (state, x))
    new_state, out = call({"w": jnp.ones(3), "tag": "kept static"}, x)
    np.testing.assert_array_equal(new_state["w"], expected_state["w"])
    assert new_state["tag"] == "kept static" and float(out) == float(expected_out)


@pytest.mark.parametrize("wrong", ["output", "arguments"])
def test_an_entry_whose_predicted_trees_the_lowering_contradicts_is_not_marked(tmp_path, wrong):
    cache = StepCache(tmp_path, rank=0)
    devices = jax.devices()[:1]
    key = step_cache.identity_key(step_cache.program_facts(devices), {"config": {"lr": 2}})
    step, state, x = _named_step()
    donate = (True, False)
    in_tree, out_tree = _predicted(step, state, x, donate)
    # A step that returned more than its state and loss, or took its batch as donated.
    other = (_predicted(step, state, x, (True, True))[0], out_tree) if wrong == "arguments" \
        else (in_tree, _predicted(step, (state, state), x, donate)[1])
    lowered = hax.named_jit(step, donate_args=donate).lower(state, x)
    compile_or_load(lowered, cache, devices, key=key, predicted=other)
    loaded = step_cache.Preload(cache, key, devices).result().loaded
    assert loaded is not None and not loaded.trees_predicted
    # Without a prediction at all, no mark either.
    compile_or_load(lowered, StepCache(tmp_path / "none", rank=0), devices, key=key)
    unmarked = step_cache.Preload(StepCache(tmp_path / "none", rank=0), key, devices)
    assert unmarked.expected and unmarked.result().loaded is not None
    assert not unmarked.result().loaded.trees_predicted


def test_the_late_check_replaces_a_step_whose_program_changed(tmp_path):
    x = jnp.arange(8.0)
    old = jax.jit(lambda v: jnp.sin(v) * 2.0 + 1.0).lower(x)
    new = jax.jit(lambda v: jnp.cos(v) - 3.0).lower(x)
    same = step_check.ProgramCheck(lambda: old, step_cache.program_digest(old.as_text()),
                                   lambda lowered: pytest.fail("compiled a matching program"))
    same.wait()
    assert same.matches and same.replacement is None and same.fields()["matches"] is True
    changed = step_check.ProgramCheck(lambda: new, step_cache.program_digest(old.as_text()),
                                      lambda lowered: lowered.compile())
    changed.wait()
    assert changed.matches is False and "compiled again" in changed.fields()["detail"]
    np.testing.assert_allclose(changed.replacement(x), np.cos(np.arange(8.0)) - 3.0, rtol=1e-6)
    broken = step_check.ProgramCheck(lambda: 1 / 0, b"", lambda lowered: None)
    broken.wait()
    assert broken.matches is None and "ZeroDivisionError" in broken.fields()["error"]
