"""The slice (DCN) axis of the trainer's mesh: devices slice-major, the batch split over slices
and data, and the same training step on one slice or two."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from tardigrade_trainer import mesh
from tardigrade_trainer.config import ConfigError, TrainerConfig


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    slice_index: int | None = None


def test_cpu_devices_go_to_slices_in_process_order():
    devices = [FakeDevice(i, i // 2) for i in (5, 4, 3, 2, 1, 0)]  # 3 processes, 2 each
    ordered = mesh.slice_order(devices, 3)
    assert [(d.process_index, d.id) for d in ordered] == [
        (0, 0), (0, 1), (1, 2), (1, 3), (2, 4), (2, 5)]


def test_tpu_devices_go_by_their_slice_index():
    # Process 1 is on slice 0 here: slice_index wins over process order.
    devices = [FakeDevice(0, 0, 1), FakeDevice(1, 0, 1), FakeDevice(2, 1, 0), FakeDevice(3, 1, 0)]
    assert [d.id for d in mesh.slice_order(devices, 2)] == [2, 3, 0, 1]


def test_devices_that_do_not_split_into_slices_are_refused():
    with pytest.raises(ConfigError, match="do not split into 4 slices"):
        mesh.slice_order([FakeDevice(i, 0) for i in range(6)], 4)


def test_the_mesh_has_a_slice_axis_and_the_batch_spans_it():
    config = TrainerConfig(global_batch_size=8)
    plan = mesh.build_mesh(config, num_slices=2)
    assert dict(plan.mesh.shape) == {"slice": 2, "data": 2, "model": 1}
    assert plan.data_size == 4
    assert plan.describe() == {"slice": 2, "data": 2, "model": 1}
    single = mesh.build_mesh(config, num_slices=1)
    assert single.describe() == {"data": 4, "model": 1}
    assert plan.batch_axes == ("slice", "data")
    assert len(jax.devices()) == 4


def test_the_slice_count_comes_from_the_multislice_environment(monkeypatch):
    monkeypatch.setenv(mesh.NUM_SLICES_ENV, "4")
    plan = mesh.build_mesh(TrainerConfig(global_batch_size=8))
    assert dict(plan.mesh.shape)["slice"] == 4


@pytest.mark.slow
def test_a_checkpoint_of_one_slice_restores_bitwise_onto_two_and_training_goes_on(tmp_path):
    import shutil

    import numpy as np
    from trainer_harness import committed_steps, launch

    base = {"steps": 20, "devices_per_process": 2, "debug_state_hash": True}
    one = launch(tmp_path / "one", processes=2, checkpoint_path=str(tmp_path / "one" / "ckpt"),
                 config=base, interval_steps=10)
    assert one.wait() == [0, 0], one.describe()
    assert committed_steps(tmp_path / "one" / "ckpt") == [10, 20]
    source = tmp_path / "one" / "ckpt" / "step_00000010"
    shutil.copytree(source, tmp_path / "two" / "ckpt" / source.name)
    # Two slices of one process each: the ranks' MEGASCALE_NUM_SLICES, as the operator sets it.
    two = launch(tmp_path / "two", processes=2, checkpoint_path=str(tmp_path / "two" / "ckpt"),
                 config=base, interval_steps=10, extra_env={mesh.NUM_SLICES_ENV: "2"})
    assert two.wait() == [0, 0], two.describe()
    assert two.events("start")[0]["mesh"] == {"slice": 2, "data": 2, "model": 1}
    restored = two.events("checkpoint_restored")[0]
    assert restored["step"] == 10 and restored["saved_mesh"] == {"data": 4, "model": 1}

    def state_hash(gang: object, step: int) -> str:
        return next(e["hash"] for e in gang.events("state_hash") if e["step"] == step)

    assert state_hash(two, 10) == state_hash(one, 10)
    losses, reference = two.losses(), one.losses()
    assert sorted(losses) == list(range(11, 21))
    np.testing.assert_allclose([losses[s] for s in losses], [reference[s] for s in losses],
                               rtol=1e-5, atol=1e-5)
