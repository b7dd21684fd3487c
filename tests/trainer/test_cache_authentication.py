"""Whoever can write the checkpoint root's compilation cache cannot make a rank run their code
(compile_cache.py, cache_seal.py): every entry a pod takes from a shared folder is sealed with
the job's cache key and checked before it is written locally, let alone loaded."""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tardigrade_contract import contract
from tardigrade_trainer import __main__ as entry
from tardigrade_trainer import cache_seal, compile_cache, step_cache
from tardigrade_trainer.compile_cache import Location, RootMirror
from tardigrade_trainer.config import TrainerConfig
from tardigrade_trainer.step_cache import StepCache, compile_or_load, entry_key

KEY = cache_seal.job_key("this job's cache key, from its Secret")
OTHER_JOB = cache_seal.job_key("another job's cache key, same bucket")
JAX_ENTRY = "jit_step-0123abcd-cache"


pytestmark = pytest.mark.usefixtures("without_jax_persistent_cache")


class _Touch:
    """Unpickling this runs `Path.touch(marker)`: any code would run the same way."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _lowered():
    x = jnp.arange(8.0)
    return jax.jit(lambda v: jnp.cos(v) * 3.0 - 1.0).lower(x), x


def _step_name(lowered) -> str:
    """The step's entry, as rank 0 of a one-process gang names it in the shared folder."""
    key = entry_key(lowered.as_text(), step_cache.program_facts(jax.devices()[:1]))
    return f"{step_cache.FOLDER}/rank-0/{key}.step"


def _weapon(lowered, marker: Path) -> bytes:
    """An entry's payload as StepCache stores it (the program's digest, its flags, then the
    pickled executable) whose unpickling creates `marker`."""
    return step_cache.payload_of(step_cache.program_digest(lowered.as_text()),
                                 pickle.dumps(_Touch(marker)))


def _step_file(scratch: Path, payload: bytes) -> bytes:
    """A step-cache file holding `payload`, with the correct SHA-256 header StepCache checks."""
    cache = StepCache(scratch, rank=0)
    cache.write("forged", payload)
    return cache.path("forged").read_bytes()


def _put(root: Path, name: str, data: bytes) -> None:
    """What someone with write access to the bucket does."""
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_bytes(data)


def _forgeries(name: str, payload: bytes) -> dict[str, bytes]:
    sealed = cache_seal.seal(KEY, name, payload)
    header = len(cache_seal.MAGIC) + cache_seal.TAG_BYTES
    return {
        "unsealed (the old format)": payload,
        "a made-up tag": cache_seal.MAGIC + os.urandom(cache_seal.TAG_BYTES) + payload,
        "truncated": sealed[:header - 5],
        "another job's key": cache_seal.seal(OTHER_JOB, name, payload),
        "sealed under another name": cache_seal.seal(KEY, name.replace("rank-0", "rank-1")
                                                     .replace("0123abcd", "4567ef01"), payload),
        "altered after sealing": sealed[:-1] + bytes([sealed[-1] ^ 1]),
    }


FORGERY_KINDS = list(_forgeries("x", b"y"))


def test_the_forged_entry_runs_code_when_loaded(tmp_path):
    # The weapon the tests below aim: a step-cache entry whose digest checks out and whose
    # unpickling runs code. Loaded from a local step cache, as the trainer loaded whatever the
    # root held before, it does.
    lowered, _ = _lowered()
    marker = tmp_path / "code-ran"
    cache = StepCache(tmp_path / "local", rank=0)
    cache.write(Path(_step_name(lowered)).stem, _weapon(lowered, marker))
    assert compile_or_load(lowered, cache, jax.devices()[:1])[1].result == "fallback"
    assert marker.exists()


@pytest.mark.parametrize("forgery", FORGERY_KINDS)
def test_a_forged_step_entry_in_the_root_is_refused_and_the_step_compiles(tmp_path, caplog,
                                                                          forgery):
    lowered, x = _lowered()
    name = _step_name(lowered)
    marker = tmp_path / "code-ran"
    root = tmp_path / "ckpt" / compile_cache.FOLDER
    weapon = _step_file(tmp_path / "scratch", _weapon(lowered, marker))
    _put(root, name, _forgeries(name, weapon)[forgery])
    pod = Location(str(tmp_path / "relaunched-pod"), str(root))

    mirror = RootMirror(pod, 0, KEY)
    with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
        pulled = mirror.pull()
    assert (pulled.files, pulled.refused) == (0, 1)
    assert not (Path(pod.local) / name).exists()
    assert f"{name!r}" in caplog.text and "refused" in caplog.text

    compiled, outcome = compile_or_load(lowered, StepCache(pod.local, rank=0), jax.devices()[:1])
    assert outcome.result == "miss"
    assert not marker.exists()
    np.testing.assert_allclose(compiled(x), np.cos(np.arange(8.0)) * 3.0 - 1.0, rtol=1e-6)

    # The pod's push replaces the refused entry with its own sealed one: the next relaunch
    # loads the step.
    assert mirror.push().files == 1
    again = Location(str(tmp_path / "next-pod"), str(root))
    assert RootMirror(again, 0, KEY).pull().files == 1
    assert compile_or_load(lowered, StepCache(again.local, rank=0),
                           jax.devices()[:1])[1].result == "hit"
    assert not marker.exists()


@pytest.mark.parametrize("forgery", FORGERY_KINDS)
def test_a_forged_jax_entry_is_not_written_locally(tmp_path, caplog, forgery):
    root = tmp_path / "ckpt" / compile_cache.FOLDER
    _put(root, JAX_ENTRY, _forgeries(JAX_ENTRY, b"an executable of the attacker's")[forgery])
    pod = Location(str(tmp_path / "pod"), str(root))
    with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
        pulled = RootMirror(pod, 1, KEY).pull()
    assert (pulled.files, pulled.refused) == (0, 1)
    assert not Path(pod.local).exists() or not any(Path(pod.local).rglob("*"))
    assert f"{JAX_ENTRY!r}" in caplog.text


def test_sealed_entries_round_trip_through_the_root(tmp_path):
    lowered, x = _lowered()
    root = tmp_path / "ckpt" / compile_cache.FOLDER
    first = Location(str(tmp_path / "first-pod"), str(root))
    assert compile_or_load(lowered, StepCache(first.local, rank=0),
                           jax.devices()[:1])[1].result == "miss"
    (Path(first.local) / JAX_ENTRY).write_bytes(b"JAX's entry")
    assert RootMirror(first, 0, KEY).push().files == 2
    # What the root holds is sealed: a reader without the key gets nothing it can load.
    stored = (root / JAX_ENTRY).read_bytes()
    assert stored.startswith(cache_seal.MAGIC) and stored != b"JAX's entry"
    assert cache_seal.unseal(KEY, JAX_ENTRY, stored) == b"JAX's entry"

    fresh = Location(str(tmp_path / "relaunched-pod"), str(root))
    pulled = RootMirror(fresh, 0, KEY).pull()
    assert (pulled.files, pulled.refused) == (2, 0)
    # The local copy is in the formats JAX and the step cache read.
    assert (Path(fresh.local) / JAX_ENTRY).read_bytes() == b"JAX's entry"
    compiled, outcome = compile_or_load(lowered, StepCache(fresh.local, rank=0),
                                        jax.devices()[:1])
    assert outcome.result == "hit"
    np.testing.assert_allclose(compiled(x), np.cos(np.arange(8.0)) * 3.0 - 1.0, rtol=1e-6)
    # The same root under another job's key: nothing of it is used.
    other = Location(str(tmp_path / "other-job-pod"), str(root))
    assert RootMirror(other, 0, OTHER_JOB).pull().refused == 2
    assert not Path(other.local).exists()


@pytest.fixture
def memory_root(monkeypatch):
    """A shared folder whose names are whatever a writer chose, as a bucket's object names are
    (a filesystem cannot hold a name with `..` in it)."""
    context = ts.Context()

    def store(self):
        return ts.KvStore.open({"driver": "memory"}, context=context).result()

    monkeypatch.setattr(RootMirror, "_store", store)
    return lambda: store(None)


SAFE_SEGMENT = st.sampled_from(["entry", JAX_ENTRY, step_cache.FOLDER, "rank-0", "k.step"])
HOSTILE_SEGMENT = st.sampled_from(["..", ".", "", ".hidden", "..\\..\\x", "nul\x00byte", "a\\b"])


@st.composite
def hostile_names(draw, sandbox: str) -> str:
    """Names that would write elsewhere than the entry they claim to be: absolute paths into
    `sandbox`, or a hostile segment anywhere, after JAX's level or this rank's own folder."""
    segments = draw(st.lists(SAFE_SEGMENT, min_size=1, max_size=4))
    lead = draw(st.sampled_from(["", f"{step_cache.FOLDER}/rank-0/", f"{sandbox}/"]))
    if not lead.startswith("/") or draw(st.booleans()):
        segments.insert(draw(st.integers(0, len(segments))), draw(HOSTILE_SEGMENT))
    return lead + "/".join(segments)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_names_that_leave_the_local_copy_write_nothing(memory_root, data):
    with tempfile.TemporaryDirectory() as scratch:
        sandbox = Path(scratch)
        local = sandbox / "pods" / "pod-0" / "copy"
        names = data.draw(st.lists(hostile_names(str(sandbox)), min_size=1, max_size=5,
                                   unique=True))
        store = memory_root()
        store.delete_range(ts.KvStore.KeyRange()).result()  # the previous example's
        for name in names:
            # Validly sealed, even: the name alone keeps it out.
            store.write(name, cache_seal.seal(KEY, name, b"payload")).result()
        pulled = RootMirror(Location(str(local), "shared"), 0, KEY).pull()
        assert (pulled.files, pulled.refused) == (0, len(names))
        assert [p for p in sandbox.rglob("*") if not p.is_dir()] == []


def test_an_unsafe_name_is_logged_and_a_safe_one_beside_it_is_taken(memory_root, tmp_path,
                                                                    caplog):
    store = memory_root()
    for name in ("../../escaped", f"{step_cache.FOLDER}/rank-0/../../../escaped",
                 f"{tmp_path}/escaped", JAX_ENTRY):
        store.write(name, cache_seal.seal(KEY, name, b"payload")).result()
    store.write(b"jit_\xff-cache", b"payload").result()
    local = tmp_path / "pod" / "copy"
    with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
        pulled = RootMirror(Location(str(local), "shared"), 0, KEY).pull()
    assert (pulled.files, pulled.refused) == (1, 4)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) \
        == [f"pod/copy/{JAX_ENTRY}"]
    assert "'../../escaped'" in caplog.text and "'..' path segment" in caplog.text
    assert "an absolute path" in caplog.text and "not UTF-8" in caplog.text


def test_a_name_through_a_link_out_of_the_local_copy_is_refused(tmp_path):
    local = tmp_path / "copy"
    (tmp_path / "elsewhere").mkdir()
    local.mkdir()
    (local / step_cache.FOLDER).symlink_to(tmp_path / "elsewhere")
    assert "outside the local cache directory" in compile_cache.unsafe_name(
        f"{step_cache.FOLDER}/rank-0/k.step", local)
    assert compile_cache.unsafe_name(f"{step_cache.FOLDER}/rank-0/k.step",
                                     tmp_path / "other") is None


def test_without_a_key_no_shared_cache_is_used(tmp_path, caplog):
    root = tmp_path / "ckpt"
    shared = compile_cache.location(None, str(root))
    with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
        where = compile_cache.for_key(shared, None)
    assert where == Location(shared.local)  # the pod's own copy, mirroring nothing
    assert contract.ENV_CACHE_KEY in caplog.text and "needs the job's cache key" in caplog.text
    env = contract.TrainerEnvironment(job_name="j", namespace="n", attempt=0,
                                      coordinator_address="127.0.0.1:1", num_processes=1,
                                      process_id=0, checkpoint_path=str(root))
    assert entry._pull_compilation_cache(where, None, env, TrainerConfig()) == (None, {})
    # A shared path configured by the user is no different.
    volume = compile_cache.location(str(tmp_path / "volume"), str(root))
    assert volume.remote == str(tmp_path / "volume") and volume.local != volume.remote
    assert compile_cache.for_key(volume, None).remote is None
    assert compile_cache.for_key(volume, KEY) == volume
    assert not root.exists() and not (tmp_path / "volume").exists()


@pytest.mark.parametrize("short", ["", "k", "fifteen-bytes!!"])
def test_a_guessable_cache_key_is_a_config_error(short):
    with pytest.raises(cache_seal.CacheKeyError, match=contract.ENV_CACHE_KEY):
        cache_seal.job_key(short)
    assert cache_seal.job_key("sixteen-bytes!!!") == b"sixteen-bytes!!!"
