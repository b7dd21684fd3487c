"""Chunk files written and read without TensorStore must be exactly what TensorStore reads."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tardigrade_checkpoint import CheckpointManager, chunkfiles, digest
from tardigrade_checkpoint.manager import COMMIT_FILE, gathered_state_hash

PLAIN = [{"name": "bytes", "configuration": {"endian": "little"}}]


def _create(path: Path, shape: tuple[int, ...], chunk: tuple[int, ...], dtype: str
            ) -> ts.TensorStore:
    metadata = {"shape": list(shape), "data_type": dtype, "codecs": PLAIN,
                "chunk_key_encoding": chunkfiles.CHUNK_KEY_ENCODING}
    if shape:
        metadata["chunk_grid"] = {"name": "regular",
                                  "configuration": {"chunk_shape": list(chunk)}}
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{path}/"},
                    "metadata": metadata}, create=True).result()


def _regions(shape: tuple[int, ...], chunk: tuple[int, ...]) -> list[tuple[slice, ...]]:
    grid = [range(0, n, c) for n, c in zip(shape, chunk, strict=True)]
    return [tuple(slice(s, s + c) for s, c in zip(starts, chunk, strict=True))
            for starts in np.ndindex(*[len(g) for g in grid])
            for starts in [tuple(g[i] for g, i in zip(grid, starts, strict=True))]]


# 4096 * 3 + 8 float32 rows of 1: an unaligned tail that O_DIRECT cannot write or read.
CASES = [((8, 3075), (4, 3075), "float32"), ((6,), (6,), "int32"), ((), (), "int32"),
         ((4, 2048), (2, 2048), "bfloat16"), ((16,), (8,), "uint8")]


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
@pytest.mark.parametrize(("shape", "chunk", "dtype"), CASES)
def test_tensorstore_reads_our_chunk_files_bit_for_bit(tmp_path, direct, shape, chunk, dtype):
    store = _create(tmp_path, shape, chunk, dtype)
    rng = np.random.default_rng(1)
    value = rng.integers(0, 255, size=shape).astype(store.dtype.numpy_dtype)
    io = chunkfiles.ChunkFileIO(direct=direct)
    shards = [(region, value[region]) for region in _regions(shape, chunk)] if shape else [
        ((), value)]
    futures, others = io.write(str(tmp_path), shape, chunk, shards)
    assert others == []
    assert sum(f.result() for f in futures) == value.nbytes
    io.close()
    read = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{tmp_path}/"}},
                   open=True).result().read().result()
    assert read.dtype == value.dtype and read.tobytes() == value.tobytes()


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
def test_reading_chunk_files_agrees_with_tensorstore(tmp_path, direct):
    shape, chunk = (8, 3075), (4, 3075)
    store = _create(tmp_path, shape, chunk, "float32")
    value = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    store.write(value).result()
    io = chunkfiles.ChunkFileIO(direct=direct)
    raw = np.empty(4 * 3075 * 4 + chunkfiles.ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % chunkfiles.ALIGNMENT
    into = raw[start : start + 4 * 3075 * 4].view(np.float32).reshape(chunk)
    assert io.can_read_into(into) and not io.can_read_into(into[:, 1:])
    found, hashed = io.read_into(str(tmp_path / "c/1/0"), into, digest.digest_array).result()
    assert found and np.array_equal(into, value[4:8])
    assert hashed == digest.digest_array(value[4:8])
    # No file: TensorStore's fill value. Wrong size: corrupt, never a silent partial read.
    assert io.read_into(str(tmp_path / "c/2/0"), into).result() == (False, None)
    (tmp_path / "c/0/0").write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match="holds 100 bytes"):
        io.read_into(str(tmp_path / "c/0/0"), into).result()
    io.close()


def test_chunk_keys_and_plain_arrays():
    assert chunkfiles.chunk_key((slice(4, 8), slice(None)), (8, 6), (4, 6)) == "c/1/0"
    assert chunkfiles.chunk_key((slice(2, 6), slice(None)), (8, 6), (4, 6)) is None
    assert chunkfiles.chunk_key((slice(0, 2),), (8,), (4,)) is None
    assert chunkfiles.chunk_key((), (), ()) == "c"
    plain = {"codecs": PLAIN}
    assert chunkfiles.is_plain(plain, {"name": "default"})
    assert chunkfiles.is_plain(plain, chunkfiles.CHUNK_KEY_ENCODING)
    assert not chunkfiles.is_plain(plain, {"name": "v2"})
    assert not chunkfiles.is_plain({"codecs": [*PLAIN, {"name": "crc32c"}]}, None)
    assert not chunkfiles.is_plain(
        {"codecs": [{"name": "bytes", "configuration": {"endian": "big"}}]}, None)


def _state(mesh: Mesh) -> dict[str, jax.Array]:
    rows = np.random.default_rng(3).standard_normal((8, 1024)).astype(np.float32)
    return {
        "w": jax.device_put(rows, NamedSharding(mesh, PartitionSpec("data"))),
        "zeros": jax.device_put(np.zeros((8, 1024), np.float32),
                                NamedSharding(mesh, PartitionSpec("data"))),
        "half": jax.device_put(rows.astype(jax.numpy.bfloat16),
                               NamedSharding(mesh, PartitionSpec("data"))),
        "count": jax.device_put(np.int32(7), NamedSharding(mesh, PartitionSpec())),
    }


def _target(mesh: Mesh, spec: PartitionSpec) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        "w": jax.ShapeDtypeStruct((8, 1024), np.float32, sharding=NamedSharding(mesh, spec)),
        "zeros": jax.ShapeDtypeStruct((8, 1024), np.float32, sharding=NamedSharding(mesh, spec)),
        "half": jax.ShapeDtypeStruct((8, 1024), jax.numpy.bfloat16,
                                     sharding=NamedSharding(mesh, spec)),
        "count": jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, PartitionSpec())),
    }


class _Spy:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.writes = self.reads = 0
        write, read_into = chunkfiles.ChunkFileIO.write, chunkfiles.ChunkFileIO.read_into

        def counting_write(io, array_dir, shape, chunk, shards):
            futures, others = write(io, array_dir, shape, chunk, shards)
            self.writes += len(futures)
            return futures, others

        def counting_read(io, path, view, then=None):
            self.reads += 1
            return read_into(io, path, view, then)

        monkeypatch.setattr(chunkfiles.ChunkFileIO, "write", counting_write)
        monkeypatch.setattr(chunkfiles.ChunkFileIO, "read_into", counting_read)


def test_a_save_and_restore_on_a_local_disk_go_through_chunk_files(tmp_path, monkeypatch):
    spy = _Spy(monkeypatch)
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    state = _state(mesh)
    manager = CheckpointManager(str(tmp_path))
    manager.save(1, state)
    manager.wait()
    assert spy.writes == 4 + 4 + 4 + 1
    for spec in (PartitionSpec("data"), PartitionSpec()):  # same mesh; all on every device
        restored, _ = manager.restore(1, _target(mesh, spec))
        assert gathered_state_hash(restored) == gathered_state_hash(state)
    assert spy.reads == 2 * (4 + 4 + 4 + 1)
    manager.close()


def test_chunks_tensorstore_left_out_are_read_through_tensorstore(tmp_path, monkeypatch):
    # Checkpoints saved through TensorStore by earlier versions (gs:// copied to a disk, or
    # with crc32c) have no file for a chunk that holds only the fill value, and no
    # `all_chunks_stored` in their commit marker: such a chunk must restore as zeros.
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    state = _state(mesh)
    manager = CheckpointManager(str(tmp_path))
    monkeypatch.setattr(manager.store, "chunk_file_writes", False)
    manager.save(1, state)
    manager.wait()
    for chunk in (tmp_path / "step_00000001/arrays/zeros").rglob("c/*/*"):
        chunk.unlink()
    marker = tmp_path / "step_00000001" / COMMIT_FILE
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items()
                                  if k != "all_chunks_stored"}))
    spy = _Spy(monkeypatch)
    restored, _ = manager.restore(1, _target(mesh, PartitionSpec("data")))
    assert spy.reads == 4 + 4 + 4 + 1
    assert gathered_state_hash(restored) == gathered_state_hash(state)
    manager.close()


def test_a_filesystem_that_refuses_o_direct_on_io_gets_ordinary_writes(tmp_path, monkeypatch):
    # Some filesystems accept O_DIRECT in open(2) and refuse the transfer with EINVAL.
    import errno

    def refuse(self, fd, view):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(chunkfiles.ChunkFileIO, "_write_aligned", refuse)
    value = np.arange(3075 * 4, dtype=np.float32).reshape(4, 3075)
    io = chunkfiles.ChunkFileIO(direct=True)
    whole = (slice(0, 4), slice(0, 3075))
    futures, _ = io.write(str(tmp_path), value.shape, value.shape, [(whole, value)])
    assert futures[0].result() == value.nbytes and io.direct is False
    assert (tmp_path / "c/0/0").read_bytes() == value.tobytes()
    io.close()


def test_either_local_disk_backend_restores_what_the_other_saved(tmp_path):
    # The chunk-file backend is an optimisation behind the storage interface, not a format:
    # a root saved with it restores through TensorStore alone, and the other way round.
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    state = {"w": jax.device_put(np.arange(64 * 8, dtype=np.float32).reshape(64, 8), sharding)}
    target = {"w": jax.ShapeDtypeStruct((64, 8), np.float32, sharding=sharding)}
    direct = CheckpointManager(str(tmp_path))
    plain = CheckpointManager(str(tmp_path), chunk_files=False)
    assert direct.chunk_io is not None and plain.chunk_io is None
    direct.save(1, state)
    direct.wait()
    plain.save(2, state)
    plain.wait()
    assert direct.chunk_io.files_written == 4  # one chunk file per shard, none for step 2
    for reader in (plain, direct):
        for step in (1, 2):
            restored, _ = reader.restore(step, target)
            assert gathered_state_hash(restored) == gathered_state_hash(state)
            assert reader.verify(step) == (4, [])
    assert direct.chunk_io.files_read == 8  # its restores of both steps read chunk files
    direct.close()
    plain.close()
