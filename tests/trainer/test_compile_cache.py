"""JAX's compilation cache beside the checkpoints (compile_cache.py): where it lives, and a
relaunched pod with an empty disk that compiles nothing because the bucket held its step."""

from __future__ import annotations

import os
import pickle
import signal
from pathlib import Path

import pytest
from tardigrade_contract import contract
from tardigrade_local.gcs import GcsEmulator, client_env
from tardigrade_trainer import cache_seal, compile_cache
from tardigrade_trainer.compile_cache import Location, RootMirror, location
from tardigrade_trainer.step_cache import StepCache
from trainer_harness import CACHE_KEY, launch, wait_for

BUCKET = "tardigrade-cache"
KEY = cache_seal.job_key(CACHE_KEY)


@pytest.fixture(scope="module")
def gcs():
    saved = {k: os.environ.get(k) for k in client_env("http://x")}
    with GcsEmulator() as emulator:
        emulator.create_bucket(BUCKET)
        os.environ.update(client_env(emulator.url))
        try:
            yield emulator
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def test_the_cache_lives_beside_the_checkpoints_unless_told_otherwise(tmp_path):
    # A local copy of the root's folder, on a filesystem as in a bucket: nothing goes into
    # a root before its gang has compiled its step there.
    on_disk = location(None, "/data/ckpt/")
    assert on_disk is not None and on_disk.remote == "/data/ckpt/compilation-cache"
    assert on_disk.local != on_disk.remote
    # A path of the user's (a volume) is shared as a bucket is: mirrored, not used in place.
    volume = location("/cache", "gs://b/job")
    assert volume is not None and volume.remote == "/cache" and volume.local != "/cache"
    assert location(None, "/data/ckpt", in_root=False) is None
    remote = location(None, "gs://b/jobs/x")
    assert remote is not None and remote.remote == "gs://b/jobs/x/compilation-cache"
    # A local copy per bucket folder, in the pod's temporary directory.
    assert remote.local != location(None, "gs://b/jobs/y").local
    assert location("gs://b/shared-cache", "/ckpt").remote == "gs://b/shared-cache"


def test_each_rank_pulls_jaxs_entries_and_its_own_folder_and_pushes_what_it_owns(gcs, tmp_path):
    remote = f"gs://{BUCKET}/mirror/{compile_cache.FOLDER}"
    first = tmp_path / "first"
    (first / "tardigrade-step-cache" / "rank-0").mkdir(parents=True)
    (first / "tardigrade-step-cache" / "rank-1").mkdir(parents=True)
    (first / "jit_step-abc-cache").write_bytes(b"jax entry")
    (first / "tardigrade-step-cache" / "rank-0" / "k0.step").write_bytes(b"rank 0 step")
    (first / "tardigrade-step-cache" / "rank-1" / "k1.step").write_bytes(b"rank 1 step")
    # Rank 1 uploads only its own folder (JAX's entries are process 0's to write)...
    assert RootMirror(Location(str(first), remote), 1, KEY).push().files == 1
    # ...rank 0 its folder and JAX's entries; nothing twice.
    assert RootMirror(Location(str(first), remote), 0, KEY).push().files == 2
    assert RootMirror(Location(str(first), remote), 0, KEY).push().files == 0
    assert sorted(gcs.list_objects(BUCKET, "mirror/")) == [
        f"mirror/{compile_cache.FOLDER}/jit_step-abc-cache",
        f"mirror/{compile_cache.FOLDER}/tardigrade-step-cache/rank-0/k0.step",
        f"mirror/{compile_cache.FOLDER}/tardigrade-step-cache/rank-1/k1.step"]

    fresh = tmp_path / "fresh-pod"
    pulled = RootMirror(Location(str(fresh), remote), 1, KEY).pull()
    assert (pulled.files, pulled.nbytes) == (2, len(b"jax entry") + len(b"rank 1 step"))
    assert (fresh / "jit_step-abc-cache").read_bytes() == b"jax entry"
    assert (fresh / "tardigrade-step-cache" / "rank-1" / "k1.step").read_bytes() == b"rank 1 step"
    assert not (fresh / "tardigrade-step-cache" / "rank-0").exists()
    assert RootMirror(Location(str(fresh), remote), 1, KEY).pull().files == 0


def _preempted_after(gang, steps: int) -> None:
    wait_for(lambda: len(gang.events("step")) >= steps, 180, f"{steps} training steps")
    wait_for(lambda: gang.events("compilation_cache_pushed"), 120, "the cache's upload")
    gang.signal(signal.SIGTERM)
    assert gang.wait() == [contract.EXIT_PREEMPTED_SAVED], gang.describe()


@pytest.mark.slow
def test_a_relaunched_pod_with_an_empty_disk_loads_its_step_from_the_bucket(gcs, tmp_path):
    url = f"gs://{BUCKET}/trainer"
    config = {"steps": 100000}

    def pod(name: str) -> dict[str, str]:
        # Each pod's own empty temporary directory: nothing survives but the bucket.
        scratch = tmp_path / f"{name}-tmp"
        scratch.mkdir()
        return {**client_env(gcs.url), "TMPDIR": str(scratch)}

    first = launch(tmp_path / "first", processes=1, checkpoint_path=url, config=config,
                   extra_env=pod("first"))
    _preempted_after(first, 3)
    assert first.events("compiled")[0]["step_cache"] == "miss"
    assert first.events("compilation_cache_pushed")[0]["uploaded_files"] >= 2

    second = launch(tmp_path / "second", processes=1, checkpoint_path=url, config=config,
                    extra_env=pod("second"))
    _preempted_after(second, 2)
    compiled = second.events("compiled")[0]
    assert compiled["cache_pulled_files"] >= 2, compiled
    assert compiled["step_cache"] == "hit", compiled
    # The step's entry came from the bucket: this pod's copy had nothing before the pull.
    assert list((tmp_path / "second-tmp").rglob("*.step"))


class _Touch:
    """Unpickling this runs `Path.touch(marker)`, in whichever process unpickles it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _root_store(url: str):
    import tensorstore as ts
    from tardigrade_checkpoint.layout import kvstore_spec

    return ts.KvStore.open(kvstore_spec(url)).result()


@pytest.mark.slow
def test_a_relaunch_refuses_what_a_bucket_writer_forged_and_compiles(gcs, tmp_path):
    url = f"gs://{BUCKET}/forged"
    config = {"steps": 100000}

    def pod(name: str) -> dict[str, str]:
        scratch = tmp_path / f"{name}-tmp"
        scratch.mkdir()
        return {**client_env(gcs.url), "TMPDIR": str(scratch)}

    first = launch(tmp_path / "first", processes=1, checkpoint_path=url, config=config,
                   extra_env=pod("first"))
    _preempted_after(first, 3)
    # Someone who may write the bucket replaces every entry the job left: its step with a
    # step-cache file whose digest checks out and whose unpickling would run their code, JAX's
    # entries with bytes of theirs.
    marker = tmp_path / "code-ran"
    store = _root_store(f"{url}/{compile_cache.FOLDER}")
    names = [k.decode() for k in store.list().result()]
    steps = [n for n in names if n.endswith(".step")]
    assert steps and len(names) > len(steps), names
    weapon = StepCache(tmp_path / "scratch", rank=0)
    weapon.write("forged", pickle.dumps(_Touch(marker)))
    for name in names:
        forged = weapon.path("forged").read_bytes() if name in steps else b"attacker's code"
        store.write(name, forged).result()

    second = launch(tmp_path / "second", processes=1, checkpoint_path=url, config=config,
                    extra_env=pod("second"))
    _preempted_after(second, 2)
    compiled = second.events("compiled")[0]
    assert compiled["step_cache"] == "miss", compiled
    assert compiled["cache_pulled_files"] == 0 and compiled["cache_pulled_refused"] == len(names)
    assert not marker.exists()
    assert "refused" in second.stderr(0).read_text()
    # The relaunch put its own sealed step back in place of the forged one (and JAX's entries
    # for what it compiled: not the initialisation's, which a restore does not run).
    for name in steps:
        cache_seal.unseal(KEY, name, store.read(name).result().value)

    # A trainer without the job's key neither reads nor writes the root's cache.
    def root_entries() -> dict[bytes, bytes]:
        return {k: store.read(k).result().value for k in store.list().result()}

    before = root_entries()
    keyless = launch(tmp_path / "keyless", processes=1, checkpoint_path=url, config=config,
                     extra_env=pod("keyless"), cache_key=None)
    wait_for(lambda: len(keyless.events("step")) >= 2, 180, "2 training steps")
    keyless.signal(signal.SIGTERM)
    assert keyless.wait() == [contract.EXIT_PREEMPTED_SAVED], keyless.describe()
    compiled = keyless.events("compiled")[0]
    assert compiled["step_cache"] == "miss" and "cache_pulled_files" not in compiled, compiled
    assert not keyless.events("compilation_cache_pushed")
    assert "needs the job's cache key" in keyless.stderr(0).read_text()
    assert root_entries() == before
