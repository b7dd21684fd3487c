"""In-process tests of the checkpoint manager on 4 CPU devices (one process)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tardigrade_checkpoint import (
    CheckpointCorruptError,
    CheckpointIOError,
    CheckpointManager,
    KeepEvery,
    KeepLast,
    keep_union,
)
from tardigrade_checkpoint.manager import COMMIT_FILE, gathered_state_hash, step_dir


def _mesh(data: int, model: int) -> Mesh:
    devices = np.array(jax.devices()[: data * model]).reshape(data, model)
    return Mesh(devices, ("data", "model"))


def _state(mesh: Mesh, seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((8, 6)).astype(np.float32)
    b = rng.standard_normal((6,)).astype(np.float32)
    return {
        "w": jax.device_put(w, NamedSharding(mesh, PartitionSpec("data", "model"))),
        "b": jax.device_put(b, NamedSharding(mesh, PartitionSpec())),
        "count": jax.device_put(np.int32(seed), NamedSharding(mesh, PartitionSpec())),
    }


def _target(mesh: Mesh, w_spec: PartitionSpec) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        "w": jax.ShapeDtypeStruct((8, 6), np.float32, sharding=NamedSharding(mesh, w_spec)),
        "b": jax.ShapeDtypeStruct((6,), np.float32, sharding=NamedSharding(mesh, PartitionSpec())),
        "count": jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, PartitionSpec())),
    }


def test_save_then_restore_onto_other_meshes_is_bitwise_identical(tmp_path):
    events: list[dict] = []
    manager = CheckpointManager(str(tmp_path), on_event=events.append)
    state = _state(_mesh(4, 1), seed=3)
    blocked = manager.save(7, state, mesh={"data": 4, "model": 1}, extra={"data_position": 8})
    info = manager.wait()
    assert info is not None and info.step == 7 and blocked >= 0
    assert json.loads((tmp_path / step_dir(7) / COMMIT_FILE).read_text())["extra"] == {
        "data_position": 8
    }
    original = gathered_state_hash(state)
    for mesh, spec in [
        (_mesh(2, 2), PartitionSpec("model", "data")),
        (_mesh(1, 1), PartitionSpec()),
        (_mesh(1, 3), PartitionSpec(None, "model")),
    ]:
        restored, restored_info = manager.restore(7, _target(mesh, spec))
        assert restored["w"].sharding.spec == spec
        assert gathered_state_hash(restored) == original
        assert restored_info.mesh == {"data": 4, "model": 1}
        # Every saved region of `w` (4), `b` and `count` checked, however the mesh cut them.
        assert events[-1]["event"] == "checkpoint_restored"
        assert events[-1]["regions_verified"] >= 6
    assert [e["event"] for e in events][:2] == ["checkpoint_started", "checkpoint_committed"]
    manager.close()


def test_a_step_that_donates_the_state_right_after_save_does_not_change_the_save(tmp_path):
    # save() returns once the snapshot is dispatched; the loop's next step donates (and may
    # overwrite) the very buffers the snapshot is being copied from.
    manager = CheckpointManager(str(tmp_path))
    mesh = _mesh(4, 1)
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    big = np.random.default_rng(4).standard_normal((4096, 1024)).astype(np.float32)
    state = {"big": jax.device_put(big, sharding), "count": jax.device_put(np.int32(1))}
    step = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x * 3 + 1, s), donate_argnums=0)
    manager.save(1, state)
    state = step(state)
    state = step(state)
    manager.wait()
    target = {"big": jax.ShapeDtypeStruct(big.shape, big.dtype, sharding=sharding),
              "count": jax.ShapeDtypeStruct((), np.int32, sharding=state["count"].sharding)}
    restored, _ = manager.restore(1, target)
    assert np.array_equal(np.asarray(restored["big"]), big) and int(restored["count"]) == 1
    assert np.allclose(np.asarray(state["big"]), (big * 3 + 1) * 3 + 1, atol=1e-4)
    manager.close()


def test_restored_buffers_shared_by_replicas_survive_a_donating_step(tmp_path):
    # On CPU, restore hands its read buffers to JAX without a copy, one buffer per distinct
    # slice, shared by every device holding a replica of it: a step that donates the state
    # must neither write through to the other replicas nor change a later restore.
    manager = CheckpointManager(str(tmp_path))
    mesh = _mesh(4, 1)
    manager.save(1, _state(mesh, seed=5))
    manager.wait()
    restored, _ = manager.restore(1, _target(mesh, PartitionSpec("data")))
    expected = {k: np.asarray(v).copy() for k, v in restored.items()}
    step = jax.jit(lambda state: jax.tree_util.tree_map(lambda x: x * 2, state),
                   donate_argnums=0)
    stepped = jax.block_until_ready(step(restored))
    for name, value in stepped.items():
        for shard in value.addressable_shards:
            assert np.array_equal(shard.data, expected[name][shard.index] * 2), name
    again, _ = manager.restore(1, _target(mesh, PartitionSpec("data")))
    assert all(np.array_equal(again[k], expected[k]) for k in expected)
    manager.close()


def test_keep_policy_deletes_only_after_a_newer_commit(tmp_path):
    manager = CheckpointManager(str(tmp_path), keep=keep_union(KeepLast(2), KeepEvery(20)))
    mesh = _mesh(4, 1)
    for step in (10, 20, 30, 40, 50):
        manager.save(step, _state(mesh, seed=step))
        manager.wait()
    committed, partial = manager.list_steps()
    assert committed == [20, 40, 50] and partial == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir(s) for s in (20, 40, 50)]
    manager.close()


def test_partial_checkpoint_is_ignored_then_collected(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    mesh = _mesh(4, 1)
    manager.save(10, _state(mesh, 10))
    manager.wait()
    manager.save(20, _state(mesh, 20))
    manager.wait()
    (tmp_path / step_dir(20) / COMMIT_FILE).unlink()  # as if the commit never happened
    assert manager.list_steps() == ([10], [20])
    assert manager.latest_committed() == 10
    with pytest.raises(CheckpointCorruptError, match="not committed"):
        manager.restore(20, _target(mesh, PartitionSpec("data")))
    assert manager.collect_partials() == [20]
    assert not (tmp_path / step_dir(20)).exists()
    assert (tmp_path / step_dir(10) / COMMIT_FILE).exists()
    manager.close()


def test_a_committed_step_is_never_rewritten(tmp_path):
    events: list[dict] = []
    manager = CheckpointManager(str(tmp_path), on_event=events.append)
    mesh = _mesh(4, 1)
    manager.save(10, _state(mesh, 1))
    manager.wait()
    before = (tmp_path / step_dir(10) / COMMIT_FILE).read_bytes()
    manager.save(10, _state(mesh, 2))
    manager.wait()
    assert (tmp_path / step_dir(10) / COMMIT_FILE).read_bytes() == before
    assert events[-1]["event"] == "checkpoint_skipped"
    restored, _ = manager.restore(10, _target(mesh, PartitionSpec("data")))
    assert int(restored["count"]) == 1
    manager.close()


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _chunk_files(root: Path, step: int, leaf: str) -> list[Path]:
    return sorted(p for p in (root / step_dir(step) / "arrays" / leaf / "c").rglob("*")
                  if p.is_file())


@pytest.mark.parametrize(("checksum", "verify", "says"), [
    (False, True, "does not hold what was saved: w\\[0:2,0:6\\]"),  # the digests (default)
    (True, False, "cannot be read"),  # the zarr crc32c codec alone
])
def test_corrupt_chunk_and_corrupt_marker_are_reported_not_restored(tmp_path, checksum, verify,
                                                                    says):
    manager = CheckpointManager(str(tmp_path), checksum=checksum, verify_restore=verify)
    mesh = _mesh(4, 1)
    manager.save(10, _state(mesh, 1))
    manager.wait()
    # Same size, different bytes: only a checksum or digest can tell.
    _flip_last_byte(_chunk_files(tmp_path, 10, "w")[0])
    with pytest.raises(CheckpointCorruptError, match=says):
        manager.restore(10, _target(mesh, PartitionSpec("data")))
    (tmp_path / step_dir(10) / COMMIT_FILE).write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match="unreadable"):
        manager.read_info(10)
    # Still committed (the marker exists), still there: reporting harms nothing.
    assert manager.list_steps() == ([10], [])
    manager.close()


@pytest.mark.parametrize(("mesh_shape", "spec"), [
    ((2, 1), PartitionSpec("data")),  # the saved shard lies inside a restored slice
    ((1, 3), PartitionSpec(None, "model")),  # every saved shard straddles restored slices
    ((1, 1), PartitionSpec()),
    ((4, 1), PartitionSpec()),  # one buffer shared by 4 replicas: checked and reported once
])
def test_a_corrupt_shard_is_caught_when_restoring_onto_another_mesh(tmp_path, mesh_shape, spec):
    manager = CheckpointManager(str(tmp_path))
    manager.save(10, _state(_mesh(4, 1), 1))
    manager.wait()
    _flip_last_byte(_chunk_files(tmp_path, 10, "w")[-1])  # rows 6:8
    with pytest.raises(CheckpointCorruptError, match=r"w\[6:8,0:6\]") as caught:
        manager.restore(10, _target(_mesh(*mesh_shape), spec))
    assert str(caught.value).count("restored") == 1
    manager.close()


def test_digests_of_a_commit_marker_must_cover_the_array(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    mesh = _mesh(4, 1)
    manager.save(10, _state(mesh, 1))
    manager.wait()
    marker = tmp_path / step_dir(10) / COMMIT_FILE
    payload = json.loads(marker.read_text())
    del payload["digests"]["w"]["2:4,0:6"]
    marker.write_text(json.dumps(payload))
    with pytest.raises(CheckpointCorruptError, match=r"digests are incomplete.*cover 36 of"):
        manager.restore(10, _target(mesh, PartitionSpec()))
    manager.close()


def test_checkpoints_with_sha256_digests_still_restore_and_verify(tmp_path):
    # Commit markers written before the algorithm was recorded hold SHA-256 digests.
    from tardigrade_checkpoint import digest

    manager = CheckpointManager(str(tmp_path))
    mesh = _mesh(4, 1)
    state = _state(mesh, 1)
    manager.save(10, state)
    manager.wait()
    marker = tmp_path / step_dir(10) / COMMIT_FILE
    payload = json.loads(marker.read_text())
    assert payload.pop("digest_algorithm") == "xxh3-128"
    w = np.asarray(state["w"])
    payload["digests"]["w"] = {
        f"{r}:{r + 2},0:6": digest.digest_array(w[r : r + 2], "sha256-128") for r in (0, 2, 4, 6)
    }
    payload["digests"]["b"] = {"0:6": digest.digest_array(np.asarray(state["b"]), "sha256-128")}
    payload["digests"]["count"] = {"": digest.digest_array(np.int32(1), "sha256-128")}
    marker.write_text(json.dumps(payload))
    restored, info = manager.restore(10, _target(_mesh(1, 3), PartitionSpec(None, "model")))
    assert info.digest_algorithm == "sha256-128"
    assert gathered_state_hash(restored) == gathered_state_hash(state)
    assert manager.verify(10) == (6, [])
    manager.close()


def test_restore_rejects_a_checkpoint_of_another_model(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    mesh = _mesh(4, 1)
    manager.save(10, _state(mesh, 1))
    manager.wait()
    target = _target(mesh, PartitionSpec())
    target["w"] = jax.ShapeDtypeStruct((8, 7), np.float32, sharding=target["w"].sharding)
    with pytest.raises(CheckpointCorruptError, match="does not match the model"):
        manager.restore(10, target)
    manager.close()


def test_unwritable_root_fails_fast(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    manager = CheckpointManager(str(blocker / "ckpt"))
    with pytest.raises(CheckpointIOError, match="not writable"):
        manager.check_writable()
    manager.close()


def test_failed_background_save_surfaces_on_wait_and_keeps_older_commits(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    mesh = _mesh(4, 1)
    manager.save(10, _state(mesh, 1))
    manager.wait()
    os.chmod(tmp_path, 0o500)
    try:
        if os.access(tmp_path, os.W_OK):
            # Root ignores permissions; break the path instead.
            os.chmod(tmp_path, 0o700)
            (tmp_path / step_dir(20)).write_text("a file where a directory must go")
        manager.save(20, _state(mesh, 2))
        with pytest.raises(CheckpointIOError, match="step_00000020"):
            manager.wait()
    finally:
        os.chmod(tmp_path, 0o700)
    assert manager.latest_committed() == 10
    manager.close()
