"""The checkpoint format as a spec (docs/checkpoint-format.md): each step is a zarr group that
plain zarr and TensorStore read; older steps restore; restore without a target; dtype casts."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tardigrade_checkpoint import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointUsageError,
)
from tardigrade_checkpoint.manager import COMMIT_FILE, step_dir

# Written by the checkpoint code before steps were zarr groups (tests/trainer/fixtures/README.md).
FORMAT2_WITHOUT_GROUPS = Path(__file__).parent / "fixtures" / "checkpoint_format2_nogroups"
BF16 = np.dtype(ml_dtypes.bfloat16)


def _mesh(data: int = 2, model: int = 2) -> Mesh:
    return Mesh(np.array(jax.devices()[: data * model]).reshape(data, model), ("data", "model"))


def _values(seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((8, 6)).astype(np.float32),
            "b": rng.standard_normal((6,)).astype(np.float32)}


def _state(seed: int = 3) -> dict[str, object]:
    mesh, values = _mesh(), _values(seed)
    return {
        "params": {"w": jax.device_put(values["w"], NamedSharding(mesh, PartitionSpec("data",
                                                                                      "model"))),
                   "b": jax.device_put(values["b"], NamedSharding(mesh, PartitionSpec()))},
        "opt_state": {"count": jax.device_put(np.int32(seed), NamedSharding(mesh,
                                                                            PartitionSpec()))},
        "key": jax.device_put(jax.random.key(seed), NamedSharding(mesh, PartitionSpec())),
    }


def _saved(root: Path, step: int = 4, seed: int = 3) -> CheckpointManager:
    manager = CheckpointManager(str(root))
    manager.save(step, _state(seed), extra={"data_position": step + 1})
    manager.wait()
    return manager


def _bits(array: object) -> np.ndarray:
    value = np.asarray(array)
    return value.view(f"u{value.dtype.itemsize}")


# --- each step is a zarr group --------------------------------------------------------------


def test_a_committed_step_is_browsed_and_read_by_plain_zarr_without_our_code(tmp_path):
    import zarr  # the dev extra's zarr-python; imported here so the other tests need none

    manager = _saved(tmp_path)
    step = tmp_path / step_dir(4)
    with warnings.catch_warnings():
        # zarr warns about the commit marker next to the group: not a zarr node, by design.
        warnings.filterwarnings("ignore", "Object at metadata.json is not recognized")
        group = zarr.open_group(step, mode="r")
        arrays = {path for path, node in group.members(max_depth=None)
                  if isinstance(node, zarr.Array)}
    assert arrays == {"arrays/params/w", "arrays/params/b", "arrays/opt_state/count",
                      "arrays/key"}
    attributes = group.attrs["tardigrade"]
    assert (attributes["step"], attributes["format"]) == (4, "tardigrade-checkpoint/2")
    assert attributes["arrays"]["params/w"] == {"shape": [8, 6], "dtype": "float32"}
    assert attributes["arrays"]["key"]["prng_impl"] == "threefry2x32"
    assert set(attributes["arrays"]) == {a.removeprefix("arrays/") for a in arrays}
    assert np.array_equal(group["arrays/params/w"][...], _values()["w"])
    assert int(group["arrays/opt_state/count"][()]) == 3
    manager.close()


def test_a_committed_step_is_listed_and_read_by_plain_tensorstore(tmp_path):
    manager = _saved(tmp_path)
    step = f"{tmp_path / step_dir(4)}/"
    kv = ts.KvStore.open({"driver": "file", "path": step}).result()
    nodes = {}
    for key in kv.list().result():
        path, _, last = key.decode().rpartition("/")
        if last == "zarr.json" or key == b"zarr.json":
            nodes[path] = json.loads(kv.read(key).result().value)["node_type"]
    assert nodes == {"": "group", "arrays": "group", "arrays/params": "group",
                     "arrays/opt_state": "group", "arrays/params/w": "array",
                     "arrays/params/b": "array", "arrays/opt_state/count": "array",
                     "arrays/key": "array"}
    w = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                "path": step + "arrays/params/w/"}}).result()
    assert np.array_equal(w.read().result(), _values()["w"])
    as_bf16 = ts.cast(w, ts.bfloat16).read().result()
    assert np.array_equal(_bits(as_bf16), _bits(_values()["w"].astype(BF16)))
    manager.close()


def test_group_files_do_not_commit_a_step_only_the_marker_does(tmp_path):
    manager = _saved(tmp_path)
    (tmp_path / step_dir(4) / COMMIT_FILE).unlink()
    assert (tmp_path / step_dir(4) / "zarr.json").exists()
    fresh = CheckpointManager(str(tmp_path))
    assert fresh.list_steps() == ([], [4])
    assert fresh.latest_committed() is None
    manager.close()
    fresh.close()


# --- older checkpoints ----------------------------------------------------------------------


def _fixture_values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(17)
    return {"w": rng.standard_normal((8, 6)).astype(np.float32),
            "b": rng.standard_normal((6,)).astype(np.float32),
            "mu": rng.standard_normal((8, 6)).astype(BF16)}


def test_a_format_2_step_written_without_group_files_restores_bitwise(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(FORMAT2_WITHOUT_GROUPS, root)
    assert not (root / step_dir(5) / "zarr.json").exists()
    mesh, want = _mesh(), _fixture_values()

    def sds(shape: tuple[int, ...], dtype: object, *spec: str | None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh,
                                                                         PartitionSpec(*spec)))

    target = {"params": {"w": sds((8, 6), np.float32, "model", "data"),
                         "b": sds((6,), np.float32)},
              "opt_state": {"mu": sds((8, 6), BF16, "data"), "count": sds((), np.int32)},
              "key": sds((), jax.eval_shape(lambda: jax.random.key(0)).dtype),
              "data_seen": np.zeros(4, np.int64)}
    manager = CheckpointManager(str(root))
    restored, info = manager.restore(5, target)
    assert np.array_equal(_bits(restored["params"]["w"]), _bits(want["w"]))
    assert np.array_equal(_bits(restored["params"]["b"]), _bits(want["b"]))
    assert np.array_equal(_bits(restored["opt_state"]["mu"]), _bits(want["mu"]))
    assert int(restored["opt_state"]["count"]) == 5
    assert np.array_equal(jax.random.key_data(restored["key"]),
                          jax.random.key_data(jax.random.key(17)))
    assert np.array_equal(restored["data_seen"], np.arange(4))
    assert info.extra == {"data_position": 6}
    # The same step without a target: the tree and dtypes come from its commit marker.
    plain, _ = manager.restore(5)
    assert sorted(plain) == ["data_seen", "key", "opt_state", "params"]
    assert plain["opt_state"]["mu"].dtype == BF16
    assert np.array_equal(_bits(plain["opt_state"]["mu"]), _bits(want["mu"]))
    assert np.array_equal(_bits(plain["params"]["w"]), _bits(want["w"]))
    manager.close()


# --- restore without a target ---------------------------------------------------------------


def test_restore_without_a_target_returns_numpy_arrays_of_the_stored_tree(tmp_path):
    manager = _saved(tmp_path)
    restored, info = manager.restore(4)
    assert set(restored) == {"params", "opt_state", "key"}
    w = restored["params"]["w"]
    assert isinstance(w, np.ndarray) and w.dtype == np.float32
    assert np.array_equal(w, _values()["w"])
    assert np.array_equal(restored["params"]["b"], _values()["b"])
    assert restored["opt_state"]["count"] == np.int32(3)
    assert np.array_equal(jax.random.key_data(restored["key"]),
                          jax.random.key_data(jax.random.key(3)))
    assert info.step == 4
    manager.close()


def test_restore_without_a_target_shards_as_requested_on_another_mesh(tmp_path):
    manager = _saved(tmp_path)
    mesh = _mesh(4, 1)
    replicated = NamedSharding(mesh, PartitionSpec())
    everywhere, _ = manager.restore(4, sharding=replicated)
    assert everywhere["params"]["w"].sharding == replicated
    assert np.array_equal(np.asarray(everywhere["params"]["w"]), _values()["w"])

    def by_leaf(name: str, shape: tuple[int, ...]) -> jax.sharding.Sharding:
        return NamedSharding(mesh, PartitionSpec("data") if name == "params/w" else
                             PartitionSpec())

    split, _ = manager.restore(4, sharding=by_leaf)
    w = split["params"]["w"]
    assert w.sharding == NamedSharding(mesh, PartitionSpec("data"))
    assert [s.data.shape for s in w.addressable_shards] == [(2, 6)] * 4
    assert np.array_equal(np.asarray(w), _values()["w"])
    assert np.array_equal(jax.random.key_data(split["key"]),
                          jax.random.key_data(jax.random.key(3)))
    with pytest.raises(CheckpointUsageError, match=r"sharding=.*without a target"):
        manager.restore(4, _target(np.float32), sharding=replicated)
    manager.close()


# --- dtype casts ----------------------------------------------------------------------------


def _target(dtype: object, mesh: Mesh | None = None) -> dict[str, object]:
    mesh = mesh or _mesh()
    replicated = NamedSharding(mesh, PartitionSpec())
    return {"params": {"w": jax.ShapeDtypeStruct((8, 6), dtype, sharding=NamedSharding(
                           mesh, PartitionSpec("data"))),
                       "b": jax.ShapeDtypeStruct((6,), dtype, sharding=replicated)},
            "opt_state": {"count": jax.ShapeDtypeStruct((), np.int32, sharding=replicated)},
            "key": jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                                        sharding=replicated)}


@pytest.mark.parametrize("verify", [True, False])
def test_a_bfloat16_target_restores_float32_weights_cast_by_tensorstore(tmp_path, verify):
    _saved(tmp_path).close()
    manager = CheckpointManager(str(tmp_path), verify_restore=verify)
    restored, _ = manager.restore(4, _target(BF16))
    w = restored["params"]["w"]
    assert w.dtype == BF16 and w.sharding == NamedSharding(_mesh(), PartitionSpec("data"))
    # Round to nearest even, as numpy's own conversion does.
    assert np.array_equal(_bits(w), _bits(_values()["w"].astype(BF16)))
    assert restored["opt_state"]["count"].dtype == np.int32
    manager.close()


def test_bfloat16_weights_restore_exactly_into_a_float32_target(tmp_path):
    manager = _saved(tmp_path)
    as_bf16, _ = manager.restore(4, _target(BF16))
    manager.save(5, as_bf16)
    manager.wait()
    restored, _ = manager.restore(5, _target(np.float32))
    assert restored["params"]["w"].dtype == np.float32
    assert np.array_equal(np.asarray(restored["params"]["w"]),
                          _values()["w"].astype(BF16).astype(np.float32))
    manager.close()


def test_an_explicit_dtype_wins_over_the_target_and_spares_integer_leaves(tmp_path):
    manager = _saved(tmp_path)
    restored, _ = manager.restore(4, _target(np.float32), dtype=BF16)
    assert restored["params"]["w"].dtype == BF16
    assert restored["params"]["b"].dtype == BF16
    assert restored["opt_state"]["count"].dtype == np.int32
    only_w, _ = manager.restore(4, dtype={"params/w": BF16})
    assert only_w["params"]["w"].dtype == BF16 and only_w["params"]["b"].dtype == np.float32
    assert np.array_equal(_bits(only_w["params"]["w"]), _bits(_values()["w"].astype(BF16)))
    with pytest.raises(CheckpointUsageError, match=r"params/v"):
        manager.restore(4, dtype={"params/v": BF16})
    manager.close()


def test_digests_check_the_stored_bytes_before_the_cast(tmp_path):
    manager = _saved(tmp_path)
    chunk = tmp_path / step_dir(4) / "arrays" / "params" / "w" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0x01  # the lowest mantissa bit of the first float32 (little-endian)
    before, after = (np.frombuffer(bytes(b[:4]), "<f4").astype(BF16)
                     for b in (chunk.read_bytes(), data))
    assert _bits(before) == _bits(after)  # invisible after the cast, and still caught
    chunk.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"params/w\[0:4,0:3\]"):
        manager.restore(4, _target(BF16))
    manager.close()


def test_a_cast_the_leaf_cannot_take_is_refused_naming_the_leaf(tmp_path):
    manager = _saved(tmp_path)
    target = _target(np.float32)
    target["key"] = jax.ShapeDtypeStruct((2,), np.float32,
                                         sharding=NamedSharding(_mesh(), PartitionSpec()))
    with pytest.raises(CheckpointCorruptError, match=r"key: checkpoint has"):
        manager.restore(4, target)
    wrong_shape = _target(BF16)
    wrong_shape["params"]["b"] = jax.ShapeDtypeStruct(
        (7,), BF16, sharding=NamedSharding(_mesh(), PartitionSpec()))
    with pytest.raises(CheckpointCorruptError, match=r"params/b: checkpoint has"):
        manager.restore(4, wrong_shape)
    manager.close()


# --- versioning -----------------------------------------------------------------------------


def test_a_step_of_a_newer_format_is_refused_naming_the_format_and_the_fix(tmp_path):
    manager = _saved(tmp_path)
    marker = tmp_path / step_dir(4) / COMMIT_FILE
    marker.write_text(json.dumps({**json.loads(marker.read_text()),
                                  "format": "tardigrade-checkpoint/3"}))
    fresh = CheckpointManager(str(tmp_path))
    with pytest.raises(CheckpointCorruptError,
                       match=r"'tardigrade-checkpoint/3' is newer than the formats this trainer "
                             r"reads \(tardigrade-checkpoint/1, tardigrade-checkpoint/2\).*"
                             r"that trainer's image"):
        fresh.restore(4)
    manager.close()
    fresh.close()
