"""What a checkpoint holds besides sharded float arrays, and what it refuses (issue 14, point 7).

In-process on 4 CPU devices; the host-local case needs a real gang of 2 processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tardigrade_checkpoint import CheckpointCorruptError, CheckpointManager
from tardigrade_checkpoint.manager import COMMIT_FILE, CheckpointUsageError, step_dir
from trainer_harness import SOURCE_PATHS, free_port


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def _like(value: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)


def test_typed_prng_keys_and_host_values_save_and_restore(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    mesh = _mesh(4)
    keys = jax.device_put(jax.random.split(jax.random.key(7), 8),
                          NamedSharding(mesh, PartitionSpec("data")))
    state = {
        "key": jax.random.key(3, impl="rbg"),
        "keys": keys,
        "table": np.arange(6, dtype=np.int16).reshape(2, 3),
        "scale": np.float32(0.5),
        "count": 41,
        "rate": 0.25,
        "flag": True,
    }
    manager.save(5, state)
    manager.wait()
    target = {**state, "key": _like(state["key"]), "keys": _like(keys)}
    restored, info = manager.restore(5, target)
    assert info.arrays["keys"] == {"shape": [8, 2], "dtype": "uint32",
                                   "prng_impl": "threefry2x32"}
    assert restored["keys"].dtype == keys.dtype and restored["keys"].sharding == keys.sharding
    assert np.array_equal(jax.random.key_data(restored["keys"]), jax.random.key_data(keys))
    assert str(jax.random.key_impl(restored["key"])) == "rbg"
    assert np.array_equal(jax.random.key_data(restored["key"]), jax.random.key_data(state["key"]))
    # The restored keys draw what the saved ones draw.
    assert np.array_equal(jax.random.normal(restored["keys"][3], (4,)),
                          jax.random.normal(keys[3], (4,)))
    assert np.array_equal(restored["table"], state["table"])
    assert restored["table"].dtype == np.int16
    assert restored["scale"] == np.float32(0.5) and isinstance(restored["scale"], np.float32)
    assert restored["count"] == 41 and type(restored["count"]) is int
    assert restored["rate"] == 0.25 and type(restored["rate"]) is float
    assert restored["flag"] is True
    # A key saved with one implementation does not restore into another.
    other = {**target, "key": _like(jax.random.key(3, impl="threefry2x32"))}
    with pytest.raises(CheckpointCorruptError, match=r"key: checkpoint has .*'prng_impl': 'rbg'"):
        manager.restore(5, other)
    manager.close()


@pytest.mark.parametrize("zeros", [False, True], ids=["data-chunk", "all-zero-chunk"])
def test_a_missing_chunk_is_an_error_even_without_verification(tmp_path, zeros):
    manager = CheckpointManager(str(tmp_path), verify_restore=False)
    sharding = NamedSharding(_mesh(4), PartitionSpec("data"))
    w = np.arange(32, dtype=np.float32).reshape(8, 4) + 1
    if zeros:
        w[2:4] = 0  # a shard equal to the fill value: TensorStore leaves such chunks out
    manager.save(3, {"w": jax.device_put(w, sharding)})
    manager.wait()
    chunk = tmp_path / step_dir(3) / "arrays" / "w" / "c" / "1" / "0"
    assert chunk.is_file()
    chunk.unlink()
    with pytest.raises(CheckpointCorruptError, match=r"chunk \{1, 0\}.* is missing"):
        manager.restore(3, {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding)})
    manager.close()


def test_checkpoints_from_before_chunks_were_all_stored_still_restore(tmp_path):
    # Their commit markers have no `all_chunks_stored`, and all-zero chunks may be absent.
    manager = CheckpointManager(str(tmp_path), verify_restore=False)
    sharding = NamedSharding(_mesh(4), PartitionSpec("data"))
    w = np.zeros((8, 4), np.float32)
    w[0:2] = 1
    manager.save(3, {"w": jax.device_put(w, sharding)})
    manager.wait()
    marker = tmp_path / step_dir(3) / COMMIT_FILE
    payload = json.loads(marker.read_text())
    del payload["all_chunks_stored"]
    marker.write_text(json.dumps(payload))
    (tmp_path / step_dir(3) / "arrays" / "w" / "c" / "3" / "0").unlink()  # all zeros
    restored, _ = manager.restore(3, {"w": jax.ShapeDtypeStruct(w.shape, w.dtype,
                                                                sharding=sharding)})
    assert np.array_equal(np.asarray(restored["w"]), w)
    manager.close()


def test_an_uneven_target_sharding_names_the_leaf_and_the_axis(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    mesh = _mesh(4)
    state = {"w": jax.device_put(np.ones((6, 4), np.float32),
                                 NamedSharding(mesh, PartitionSpec(None, "data")))}
    manager.save(2, state)
    manager.wait()
    uneven = NamedSharding(mesh, PartitionSpec("data"))  # 6 rows over 4 devices
    with pytest.raises(CheckpointUsageError,
                       match=r"'w' of shape \(6, 4\): dimension 0 \(size 6\) is split over "
                             r"mesh axis 'data' \(4\), 4 parts that do not divide it"):
        manager.restore(2, {"w": jax.ShapeDtypeStruct((6, 4), np.float32, sharding=uneven)})
    manager.close()


_HOST_LOCAL = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2,
                               process_id=int(sys.argv[2]), initialization_timeout=150)
    from tardigrade_checkpoint import CheckpointManager
    from tardigrade_checkpoint.manager import CheckpointUsageError
    manager = CheckpointManager(sys.argv[3])
    local = jax.device_put(np.full(4, jax.process_index(), np.float32), jax.local_devices()[0])
    try:
        manager.save(1, {"params": {"bias": local}})
        manager.wait()
        result = {"saved": True}
    except CheckpointUsageError as err:
        result = {"refused": str(err)}
    print(json.dumps(result), flush=True)
    jax.distributed.shutdown()
""")


@pytest.mark.slow
def test_a_host_local_array_is_refused_in_a_gang(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    env = {"PYTHONPATH": ":".join(SOURCE_PATHS), "JAX_PLATFORMS": "cpu",
           "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", _HOST_LOCAL, address, str(rank),
                               str(tmp_path / "ckpt")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for rank in (0, 1)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err.decode()[-2000:]
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    for result in results:
        assert "params/bias" in result["refused"], result
        assert "host-local jax.Array" in result["refused"]
    assert not (tmp_path / "ckpt" / step_dir(1)).exists()
