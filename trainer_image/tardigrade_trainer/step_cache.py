"""A per-rank cache of the compiled training step, beside JAX's persistent compilation cache.

JAX 0.10.2 writes persistent-cache entries from process 0 only (jax/_src/compiler.py,
`_cache_write`), and its key holds the devices' topology fingerprint (jax/_src/cache_key.py,
`_hash_accelerator_config`), which differs between the CPU processes of one gang: so every rank
but 0 compiled the step from scratch at every relaunch. Here each rank keeps its own compiled
step, serialized with JAX's public `jax.experimental.serialize_executable`, in a folder of its
own under the compilation cache's directory, keyed by everything that makes the executable
valid for this process (`program_facts`, `entry_key`).

Its digest (a SHA-256 with no key) is checked before an entry is loaded: that catches a torn or
truncated file, not a forged one. An entry that does not load falls back to compiling, with the
reason in the outcome. Only a step compiled here is stored: one that JAX loaded from its own
cache (rank 0's, mostly) serializes without its CPU object code and would fail when run
("NOT_FOUND: Function ... not found"; reproduced with jax 0.10.2), and JAX's cache serves that
rank anyway.

Loading unpickles the entry (as `deserialize_and_load` warns: a crafted entry runs any code),
so the folder is trusted, and must be one only this pod writes: the trainer keeps it in the
pod's local copy of the cache (compile_cache.py), never in a shared folder. What comes from a
shared folder (the checkpoint root, a bucket, a shared volume) reaches this folder only through
`compile_cache.RootMirror.pull`, which writes an entry only once its HMAC seal with the job's
cache key checks out (cache_seal.py); the entry's name, which the seal covers, is its
`entry_key`, so a valid entry cannot be served for another program or another rank.

A relaunch need not trace the step before it starts loading it. The reference trainer names its
entry by what determines the program without tracing it (`identity_key`: the process's facts,
the trainer's source, the libraries' versions and the configuration), and `Preload` reads and
loads that entry onto the devices in a thread of its own from the moment the devices are up,
while the state's shapes are worked out, the step is traced and lowered and the state restored.
In a gang the loaded executable is used only once the lowering is done and the program digest
the entry was stored with equals the lowered program's: anything that changed the program
without changing the key (a library's behaviour, an environment variable) is compiled, never
run. A gang of one runs it before any trace where the entry says the argument and output trees
its caller worked out without tracing (`predicted`, compiled_step.predicted_trees) were the
lowering's, and checks the program once the loop runs (step_check.py). Loading
it before its trees are known takes the first half of JAX's `deserialize_and_load`
(`_JaxPjrtUnpickler`, private in jax 0.10.2): where that is not there, the entry is loaded after
the lowering, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FOLDER = "tardigrade-step-cache"
# Entries kept per rank: a world size or a program that changed leaves its old entry behind,
# and a gang that grows back finds the previous one.
DEFAULT_KEEP = 4
_MAGIC = b"tardigrade-step-cache 4\n"
# Each entry's payload: the SHA-256 of the program it was compiled from, a byte of flags, then
# the executable.
_PROGRAM_DIGEST_BYTES = 32
_HEADER_BYTES = _PROGRAM_DIGEST_BYTES + 1
# The flag: the argument and output trees the caller predicts without tracing (`predicted`)
# were those of the lowering the entry was compiled from, so a relaunch may wrap the
# executable in them before anything is traced.
_TREES_PREDICTED = 1
_SUFFIX = ".step"
# A temporary file this old belongs to a writer that died before its rename.
_STALE_TEMP_SECONDS = 3600.0


_jax_cache_hits: dict[int, int] = {}  # by compiling thread
_listening = False
_lock = threading.Lock()


def _count_jax_cache_hits(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        with _lock:
            thread = threading.get_ident()
            _jax_cache_hits[thread] = _jax_cache_hits.get(thread, 0) + 1


def _jax_cache_hits_so_far() -> int:
    """Hits in JAX's persistent cache by this thread since the first call (from JAX's
    monitoring events, which jax/_src/compiler.py records in the compiling thread: another
    thread's compiles, such as the state's initialisation, are not this one's)."""
    global _listening
    with _lock:
        if not _listening:
            from jax import monitoring

            monitoring.register_event_listener(_count_jax_cache_hits)
            _listening = True
        return _jax_cache_hits.get(threading.get_ident(), 0)


class CorruptEntryError(ValueError):
    """An entry's bytes are not what its writer wrote (torn, truncated, or overwritten)."""


def program_facts(devices: Sequence[Any]) -> dict[str, Any]:
    """Besides the program itself, what makes a compiled step valid for this process: the JAX
    and jaxlib versions, the backend and its version, this process's place in the gang, the
    devices the step runs on (in the order it was compiled for) and the XLA flags."""
    import jax
    import jaxlib

    client = devices[0].client
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": client.platform,
        "platform_version": client.platform_version,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": [[d.id, d.process_index, d.device_kind] for d in devices],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def entry_key(program_text: str, facts: Mapping[str, Any]) -> str:
    """The entry's name: a digest of the lowered program's text and of `facts`."""
    digest = hashlib.sha256()
    digest.update(hashlib.sha256(program_text.encode()).digest())
    digest.update(json.dumps(facts, sort_keys=True).encode())
    return digest.hexdigest()


def program_digest(program_text: str) -> bytes:
    return hashlib.sha256(program_text.encode()).digest()


def identity_key(facts: Mapping[str, Any], identity: Mapping[str, Any]) -> str:
    """An entry's name known before the step is traced: `facts` (program_facts) and what the
    caller says determines the program (its source, libraries and configuration). The entry
    still records the program it holds, which is checked before it is used."""
    digest = hashlib.sha256(b"identity\n")
    digest.update(json.dumps({"facts": facts, "identity": identity}, sort_keys=True,
                             default=str).encode())
    return digest.hexdigest()


def source_digest(*folders: Path) -> str:
    """A digest of the Python source under `folders` (a program that changed with it is
    another program)."""
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            digest.update(str(path.relative_to(folder)).encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()


def library_versions(*names: str) -> dict[str, str]:
    from importlib import metadata

    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


class StepCache:
    """One rank's folder of serialized steps: written atomically, at most `keep` entries."""

    def __init__(self, root: str | Path, rank: int, keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError(f"a step cache must keep at least 1 entry, got keep={keep}")
        self.folder = Path(root) / FOLDER / f"rank-{rank}"
        self.keep = keep

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{_SUFFIX}"

    def read(self, key: str) -> bytes | None:
        """The entry's payload; None when there is none; CorruptEntryError when its digest does
        not match."""
        try:
            data = self.path(key).read_bytes()
        except FileNotFoundError:
            return None
        header = len(_MAGIC) + hashlib.sha256().digest_size
        if len(data) < header or not data.startswith(_MAGIC):
            raise CorruptEntryError(f"{self.path(key)}: not a step cache entry")
        payload = data[header:]
        if hashlib.sha256(payload).digest() != data[len(_MAGIC):header]:
            raise CorruptEntryError(f"{self.path(key)}: digest mismatch ({len(payload)} bytes)")
        # Used now: the bound evicts the entries used least recently.
        with contextlib.suppress(OSError):
            os.utime(self.path(key))
        return payload

    def write(self, key: str, payload: bytes) -> None:
        """Store the entry whole or not at all (a reader never sees half of it), then evict the
        entries used least recently beyond `keep`."""
        self.folder.mkdir(parents=True, exist_ok=True)
        temp = self.folder / f".{key}.{os.getpid()}.tmp"
        try:
            with open(temp, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(payload).digest() + payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, self.path(key))
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
        self._evict()

    def discard(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(key).unlink()

    def entries(self) -> list[Path]:
        """The entries, most recently used first."""
        found = []
        for path in self.folder.glob(f"*{_SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):  # evicted by another writer meanwhile
                found.append((path.stat().st_mtime, path))
        return [path for _, path in sorted(found, reverse=True)]

    def _evict(self) -> None:
        for path in self.entries()[self.keep:]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        now = time.time()
        for temp in self.folder.glob(".*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                if now - temp.stat().st_mtime > _STALE_TEMP_SECONDS:
                    temp.unlink()


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How this rank got its step: `hit` (loaded), `miss` (compiled and stored), `fallback`
    (an entry was there but did not load: compiled and stored), `jax_cache` (JAX's own
    persistent cache had it: not stored), `off` (no cache: compiled)."""

    result: str
    seconds: float  # loading it, or compiling and storing it
    detail: str | None = None  # why an entry did not load, or could not be stored
    # A hit used before the step was traced (its program is checked after the first step).
    untraced: bool = False

    def fields(self) -> dict[str, Any]:
        """For the trainer's `compiled` log line."""
        found: dict[str, Any] = {"step_cache": self.result,
                                 "step_cache_seconds": round(self.seconds, 3)}
        if self.detail:
            found["step_cache_detail"] = self.detail
        if self.untraced:
            found["step_untraced"] = True
        return found


@dataclasses.dataclass
class Loaded:
    """An entry loaded onto the devices before the program's trees are known: what JAX's
    `deserialize_and_load` holds between its unpickling and its `Compiled`."""

    program: bytes  # the digest of the program it was compiled from
    executable: Any  # the loaded executable
    args_info_flat: Any
    no_kwargs: bool
    trees_predicted: bool = False  # stored with the _TREES_PREDICTED flag

    def compiled(self, lowered: Any) -> Any:
        import jax

        return self.compiled_with(jax.tree_util.tree_structure(lowered.args_info),
                                  lowered.out_tree)

    def compiled_with(self, in_tree: Any, out_tree: Any) -> Any:
        """Wrapped in the argument and output trees of the program (a lowering's, or those
        predicted without tracing where the entry says they were the lowering's)."""
        import jax

        return jax.stages.Compiled(self.executable, [], in_tree.unflatten(self.args_info_flat),
                                   out_tree, no_kwargs=self.no_kwargs)


def _load(payload: bytes, devices: Sequence[Any]) -> Loaded:
    """Unpickle and load an entry's executable (the expensive part of loading a step)."""
    import io

    from jax.experimental import serialize_executable

    program = payload[:_PROGRAM_DIGEST_BYTES]
    flags = payload[_PROGRAM_DIGEST_BYTES]
    unpickler = serialize_executable._JaxPjrtUnpickler(
        io.BytesIO(payload[_HEADER_BYTES:]), devices[0].client, list(devices))
    unloaded, args_info_flat, no_kwargs = unpickler.load()
    return Loaded(program, unloaded.load(), args_info_flat, no_kwargs,
                  trees_predicted=bool(flags & _TREES_PREDICTED))


def _can_preload() -> bool:
    from jax.experimental import serialize_executable

    return hasattr(serialize_executable, "_JaxPjrtUnpickler")


@dataclasses.dataclass(frozen=True)
class Preloaded:
    """What `Preload` found: the entry loaded, none, or one that did not load (why)."""

    loaded: Loaded | None
    seconds: float
    found: bool
    detail: str | None = None


class Preload:
    """The entry `key` read and loaded onto `devices` in a thread of its own, started now:
    before the step is traced. `result()` waits for it."""

    def __init__(self, cache: StepCache, key: str, devices: Sequence[Any]) -> None:
        self.cache, self.key, self.devices = cache, key, list(devices)
        self._done = threading.Event()
        self._result = Preloaded(None, 0.0, False)
        # Known at once (no read): whether the caller may count on an entry before its load
        # is done, and skip the tracing it would otherwise start now.
        self.expected = _can_preload() and cache.path(key).exists()
        if not _can_preload():
            self._done.set()
            return
        threading.Thread(target=self._run, name="preload-step", daemon=True).start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            payload = self.cache.read(self.key)
            if payload is not None:
                self._result = Preloaded(_load(payload, self.devices),
                                         time.perf_counter() - started, True)
        except Exception as err:  # whatever a bad entry raises, compiling is the way out
            why = (f"entry {self.key[:12]} did not load ({type(err).__name__}: {err}); "
                   "compiled instead")
            log.warning("step cache: %s", why)
            self.cache.discard(self.key)
            self._result = Preloaded(None, time.perf_counter() - started, True, why)
        finally:
            self._done.set()

    def wait(self) -> None:
        self._done.wait()

    def result(self) -> Preloaded:
        self._done.wait()
        return self._result


def compile_or_load(lowered: Any, cache: StepCache | None, devices: Sequence[Any],
                    on_backend: Callable[[], None] = lambda: None, key: str | None = None,
                    preload: Preload | None = None,
                    predicted: tuple[Any, Any] | None = None) -> tuple[Any, Outcome]:
    """The `jax.stages.Compiled` of `lowered` (compiled for `devices`, in that order), from
    `cache` when it holds it, else compiled and stored there. `on_backend` is called once the
    Python side is done, as the backend starts loading or compiling (which release the GIL).

    The entry is named `key` where the caller names it without tracing (`identity_key`),
    else by the lowered program (`entry_key`); `preload` is that entry already being loaded.
    Either way an entry is used only for the program it was stored with. `predicted`: the
    argument and output trees the caller works out without tracing; an entry stored here
    says whether they were the lowering's (`Loaded.trees_predicted`)."""
    started = time.perf_counter()
    if cache is None:
        on_backend()
        return lowered.compile(), Outcome("off", time.perf_counter() - started)
    from jax.experimental import serialize_executable

    text = lowered.as_text()
    program = program_digest(text)
    key = key or entry_key(text, program_facts(devices))
    on_backend()
    why: str | None = None
    found = False
    if preload is not None and preload.key == key:
        got = preload.result()
        found, why = got.found, got.detail
        if got.loaded is not None:
            if got.loaded.program == program:
                return got.loaded.compiled(lowered), Outcome("hit", got.seconds)
            why = (f"entry {key[:12]} holds another program than the one lowered now (the "
                   "program changed without its key); compiled instead")
            log.warning("step cache: %s", why)
            cache.discard(key)
    else:
        try:
            payload = cache.read(key)
            found = payload is not None
            if payload is not None:
                if payload[:_PROGRAM_DIGEST_BYTES] != program:
                    raise CorruptEntryError("it holds another program than the one lowered")
                import jax

                compiled = serialize_executable.deserialize_and_load(
                    payload[_HEADER_BYTES:],
                    jax.tree_util.tree_structure(lowered.args_info), lowered.out_tree,
                    backend=devices[0].client, execution_devices=list(devices))
                return compiled, Outcome("hit", time.perf_counter() - started)
        except Exception as err:  # whatever a bad entry raises, compiling is the way out
            found = True
            why = f"entry {key[:12]} did not load ({type(err).__name__}: {err}); compiled instead"
            log.warning("step cache: %s", why)
            cache.discard(key)
    hits_before = _jax_cache_hits_so_far()
    compiled = lowered.compile()
    if _jax_cache_hits_so_far() > hits_before:
        return compiled, Outcome("jax_cache", time.perf_counter() - started, why)
    held = predicted is not None and predicted_trees_hold(predicted, lowered)
    try:
        cache.write(key, payload_of(program, serialize_executable.serialize(compiled)[0], held))
    except Exception as err:  # a full disk or an executable JAX cannot serialize
        note = f"not stored ({type(err).__name__}: {err})"
        log.warning("step cache: %s", note)
        why = f"{why}; {note}" if why else note
    return compiled, Outcome("fallback" if found else "miss",
                             time.perf_counter() - started, why)


def payload_of(program: bytes, executable: bytes, trees_predicted: bool = False) -> bytes:
    """An entry's payload: the digest of the program it was compiled from, its flags, then the
    serialized executable."""
    return program + bytes([_TREES_PREDICTED if trees_predicted else 0]) + executable


def predicted_trees_hold(predicted: tuple[Any, Any], lowered: Any) -> bool:
    """Whether trees worked out without tracing are those of `lowered`."""
    import jax

    in_tree, out_tree = predicted
    return bool(in_tree == jax.tree_util.tree_structure(lowered.args_info)
                and out_tree == lowered.out_tree)
