"""Where the reference trainer keeps JAX's compilation cache: by default beside its checkpoints.

A relaunched gang on GKE runs in new pods, often on other nodes: a cache on a pod's own disk
is gone, and compiling the reference model's step takes 30 s on a TPU v5e (the whole first
step, against about 4 s to load it from a cache). The checkpoint root is the one storage every
pod of every attempt of the job shares and keeps, so unless `compilation_cache_dir` names
another place, the cache lives under `<checkpoint root>/compilation-cache/`, in a bucket
(gs://) or on a filesystem alike. `compilation_cache_dir` set to a gs:// URL or to a path (a
volume the pods share) puts that shared folder elsewhere; `compilation_cache_in_root: false`
turns the default off.

JAX reads its cache from a local directory, which only this pod writes: the pod's temporary
directory, never the shared folder itself (a shared path is mirrored as a bucket is, not used
in place). `pull` fills the local copy from the shared folder before the first compile (JAX's
entries, which every rank reads, and this rank's own step-cache folder, step_cache.py); `push`
writes to the shared folder, after the step is compiled and from a thread of its own, what the
copy has and the folder lacks: JAX's entries from process 0 (JAX writes its cache from process
0 only) and each rank's own folder. So nothing is written into a root before its gang has
opened it (a root that belongs to another job, or that a gang refuses, stays as it was).

What is trusted, and what is checked. The entries are programs the trainer runs (JAX runs its
cache's executables; a step-cache entry is unpickled), and others may be able to write the
shared folder (whoever can write to the bucket). So the shared folder is untrusted: every entry
in it is sealed with the job's secret cache key (cache_seal.py: HMAC-SHA256 over the entry's
name and bytes; `contract.ENV_CACHE_KEY`, from the job's Secret), and `pull` checks the seal
before it writes anything locally: an entry without a valid tag (unsealed, older format,
truncated, sealed with another job's key, or moved from another name) is refused with a
warning naming it and why, never written locally, and the step is compiled instead (`push`
then replaces it with this pod's sealed entry). A name that would leave the local directory
(`..` segments, an absolute path, a backslash or NUL, a path resolving outside it) is refused
the same way. The local directory is trusted as the pod itself is.

Someone who can write the shared folder can still delete entries (the next start compiles) or
put back an older entry of this job, sealed by it, under the same name. That serves nothing
else: an entry's name is a digest of what it was compiled from (program, compiler, devices),
so an entry replayed under its own name is the same program, compiled by this job.

Without a cache key (a trainer not started by the operator, with TARDIGRADE_CACHE_KEY unset)
the shared folder is neither read nor written (logged once): the cache is the pod's local
directory alone, which nobody else writes, and which serves restarts within the pod (the
attempts that run in child processes) but not a relaunch on new pods. With a key, the default
in the checkpoint root is on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tardigrade_contract import contract

from tardigrade_trainer import cache_seal, step_cache

log = logging.getLogger(__name__)

FOLDER = "compilation-cache"


@dataclasses.dataclass(frozen=True)
class Location:
    """The directory JAX uses (`local`, the pod's own), and the shared folder it mirrors, if
    any."""

    local: str
    remote: str | None = None


def location(configured: str | None, checkpoint_root: str, in_root: bool = True
             ) -> Location | None:
    """Where the cache lives: `configured` (a path or a gs:// URL), else the checkpoint root's
    folder (unless `in_root` is false: no cache). Either is shared, so mirrored into a local
    directory of the pod's own."""
    where = configured or (f"{checkpoint_root.rstrip('/')}/{FOLDER}" if in_root else None)
    if where is None:
        return None
    digest = hashlib.sha256(where.encode()).hexdigest()[:16]
    local = os.path.join(tempfile.gettempdir(), "tardigrade-compilation-cache", digest)
    return Location(local, where)


def for_key(where: Location | None, key: bytes | None) -> Location | None:
    """The cache this process may use: the shared folder only with the job's cache key (its
    entries are checked with it); without one, the pod's local directory alone."""
    if where is None or where.remote is None or key is not None:
        return where
    log.warning("compilation cache: %s not used: the compilation cache in the checkpoint root "
                "(or any shared one) needs the job's cache key, which the operator sets "
                "(or set %s); only this pod's own copy, %s, is used", where.remote,
                contract.ENV_CACHE_KEY, where.local)
    return Location(where.local)


def unsafe_name(key: str, local: str | Path) -> str | None:
    """Why an entry's name in the shared folder may not become a file under `local`, or None
    when it may."""
    if not key:
        return "an empty name"
    if "\x00" in key or "\\" in key:
        return "a NUL or a backslash in the name"
    if key.startswith("/"):
        return "an absolute path"
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "an empty, '.' or '..' path segment"
    if any(part.startswith(".") for part in parts):
        return "a hidden name (the mirror's temporary files are named so)"
    root = Path(local).resolve()
    if not (root / key).resolve().is_relative_to(root):
        return "a path outside the local cache directory"
    return None


@dataclasses.dataclass(frozen=True)
class Transfer:
    files: int
    nbytes: int
    seconds: float
    refused: int = 0  # entries whose name or seal did not check out

    def fields(self, prefix: str) -> dict[str, Any]:
        found = {f"{prefix}_files": self.files, f"{prefix}_bytes": self.nbytes,
                 f"{prefix}_seconds": round(self.seconds, 3)}
        if self.refused:
            found[f"{prefix}_refused"] = self.refused
        return found


class RootMirror:
    """The local copy of a shared folder of cache entries (in a bucket or on a filesystem), for
    one rank; entries there are sealed with `key` (cache_seal.py)."""

    def __init__(self, where: Location, rank: int, key: bytes,
                 context_spec: dict[str, Any] | None = None) -> None:
        assert where.remote is not None
        self.where = where
        self.rank = rank
        self.key = key
        self.context_spec = context_spec or {}
        self._own = f"{step_cache.FOLDER}/rank-{rank}/"
        # Names whose shared entry this rank refused: its push replaces them.
        self._refused: set[str] = set()

    def _store(self) -> Any:
        import tensorstore as ts
        from tardigrade_checkpoint.layout import kvstore_spec

        assert self.where.remote is not None
        return ts.KvStore.open(kvstore_spec(self.where.remote),
                               context=ts.Context(self.context_spec)).result()

    def _mine(self, key: str) -> bool:
        """Entries this rank reads: JAX's (top level), and its own step-cache folder."""
        return "/" not in key or key.startswith(self._own)

    def _refuse(self, key: str, why: str) -> None:
        log.warning("compilation cache: entry %r in %s refused (%s): not written locally; "
                    "what it would hold is compiled instead", key, self.where.remote, why)

    def pull(self) -> Transfer:
        """Copy into the local directory the entries this rank reads that it lacks, each once
        its name and seal check out."""
        started = time.monotonic()
        store = self._store()
        local = Path(self.where.local)
        wanted, refused = [], 0
        for raw in store.list().result():
            key = raw.decode(errors="replace")
            why = unsafe_name(key, local) if key.encode() == raw else "a name that is not UTF-8"
            if why is not None:
                refused += 1
                self._refuse(key, why)
            elif self._mine(key) and not (local / key).exists():
                wanted.append(key)
        reads = [(k, store.read(k)) for k in wanted]
        files = nbytes = 0
        for key, future in reads:
            try:
                payload = cache_seal.unseal(self.key, key, future.result().value)
            except cache_seal.UnauthenticatedEntryError as err:
                refused += 1
                self._refused.add(key)
                self._refuse(key, str(err))
                continue
            files += 1
            nbytes += len(payload)
            _write_whole(local / key, payload)
        return Transfer(files, nbytes, time.monotonic() - started, refused)

    def push(self) -> Transfer:
        """Seal and write to the shared folder the local entries this rank owns that it lacks
        or whose entry there this rank refused (process 0: JAX's too)."""
        started = time.monotonic()
        root = Path(self.where.local)
        local = [str(p.relative_to(root)) for p in root.rglob("*")
                 if p.is_file() and not p.name.startswith(".")]
        owned = [k for k in local if k.startswith(self._own) or ("/" not in k and self.rank == 0)]
        if not owned:
            return Transfer(0, 0, time.monotonic() - started)
        store = self._store()
        there = {k.decode(errors="replace") for k in store.list().result()} - self._refused
        writes = []
        nbytes = 0
        for key in owned:
            if key in there:
                continue
            data = (root / key).read_bytes()
            nbytes += len(data)
            writes.append(store.write(key, cache_seal.seal(self.key, key, data)))
        for write in writes:
            write.result()
        return Transfer(len(writes), nbytes, time.monotonic() - started)


def _write_whole(path: Path, data: bytes) -> None:
    """A reader (JAX) never sees half an entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temp.write_bytes(data)
        os.replace(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()


def push_in_background(mirror: RootMirror, on_done: Any) -> threading.Thread:
    """Upload from a daemon thread (training goes on; an unfinished upload is only a slower
    next start); `on_done(fields)` gets the transfer's figures, or its error."""

    def run() -> None:
        try:
            on_done(mirror.push().fields("uploaded"))
        except Exception as err:  # the bucket said no: the next start compiles, no more
            log.warning("compilation cache: upload to %s failed: %s", mirror.where.remote, err)
            on_done({"upload_error": str(err)})

    thread = threading.Thread(target=run, name="compilation-cache-push", daemon=True)
    thread.start()
    return thread
