"""Where the reference trainer keeps JAX's compilation cache: by default beside its checkpoints.

A relaunched gang on GKE runs in new pods, often on other nodes: a cache on a pod's own disk
is gone, and compiling the reference model's step takes 30 s on a TPU v5e (the whole first
step, against about 4 s to load it from a cache). The checkpoint root is the one storage every
pod of every attempt of the job shares and keeps, so unless `compilation_cache_dir` names
another place, the cache lives under `<checkpoint root>/compilation-cache/`, in a bucket
(gs://) or on a filesystem alike. JAX's cache is a local directory, so each pod keeps a local
copy: `pull` fills it from the root before the first compile (JAX's entries, which every rank
reads, and this rank's own step-cache folder, step_cache.py); `push` writes to the root, after
the step is compiled and from a thread of its own, what the copy has and the root lacks: JAX's
entries from process 0 (JAX writes its cache from process 0 only) and each rank's own folder.
So nothing is written into a root before its gang has opened it (a root that belongs to
another job, or that a gang refuses, stays as it was). An entry's name is a digest of what it
was compiled from (program, compiler, devices), so entries of the job's other configurations
never serve the wrong program; step-cache entries are checked against their digests before
they are loaded.

The folder holds machine code that the trainer runs (as JAX runs its cache's programs), so it
must be writable only by the job's pods, as its checkpoints are. `compilation_cache_dir` set
to a path or a gs:// URL puts the cache there instead (a volume shared by the pods); the key
`compilation_cache_in_root: false` turns the default off.
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

from tardigrade_trainer import step_cache

log = logging.getLogger(__name__)

FOLDER = "compilation-cache"


@dataclasses.dataclass(frozen=True)
class Location:
    """The directory JAX uses (`local`), and the bucket folder it mirrors, if any."""

    local: str
    remote: str | None = None


def location(configured: str | None, checkpoint_root: str, in_root: bool = True
             ) -> Location | None:
    """Where the cache lives: `configured` (a path, used in place, or a gs:// URL), else the
    checkpoint root's folder (unless `in_root` is false: no cache)."""
    if configured and not configured.startswith("gs://"):
        return Location(configured)
    where = configured or (f"{checkpoint_root.rstrip('/')}/{FOLDER}" if in_root else None)
    if where is None:
        return None
    digest = hashlib.sha256(where.encode()).hexdigest()[:16]
    local = os.path.join(tempfile.gettempdir(), "tardigrade-compilation-cache", digest)
    return Location(local, where)


@dataclasses.dataclass(frozen=True)
class Transfer:
    files: int
    nbytes: int
    seconds: float

    def fields(self, prefix: str) -> dict[str, Any]:
        return {f"{prefix}_files": self.files, f"{prefix}_bytes": self.nbytes,
                f"{prefix}_seconds": round(self.seconds, 3)}


class RootMirror:
    """The local copy of a folder of cache entries (in a bucket or on a filesystem), for one
    rank."""

    def __init__(self, where: Location, rank: int, context_spec: dict[str, Any] | None = None
                 ) -> None:
        assert where.remote is not None
        self.where = where
        self.rank = rank
        self.context_spec = context_spec or {}
        self._own = f"{step_cache.FOLDER}/rank-{rank}/"

    def _store(self) -> Any:
        import tensorstore as ts

        from tardigrade_trainer.checkpoint.layout import kvstore_spec

        assert self.where.remote is not None
        return ts.KvStore.open(kvstore_spec(self.where.remote),
                               context=ts.Context(self.context_spec)).result()

    def _mine(self, key: str) -> bool:
        """Entries this rank reads: JAX's (top level), and its own step-cache folder."""
        return "/" not in key or key.startswith(self._own)

    def pull(self) -> Transfer:
        """Download the entries this rank reads that its local copy lacks."""
        started = time.monotonic()
        store = self._store()
        keys = [k.decode() for k in store.list().result()]
        wanted = [k for k in keys if self._mine(k) and not (Path(self.where.local) / k).exists()]
        reads = [(k, store.read(k)) for k in wanted]
        nbytes = 0
        for key, future in reads:
            value = future.result().value
            nbytes += len(value)
            _write_whole(Path(self.where.local) / key, value)
        return Transfer(len(reads), nbytes, time.monotonic() - started)

    def push(self) -> Transfer:
        """Write to the root the local entries this rank owns that it lacks (process 0: JAX's
        too)."""
        started = time.monotonic()
        root = Path(self.where.local)
        local = [str(p.relative_to(root)) for p in root.rglob("*")
                 if p.is_file() and not p.name.startswith(".")]
        owned = [k for k in local if k.startswith(self._own) or ("/" not in k and self.rank == 0)]
        if not owned:
            return Transfer(0, 0, time.monotonic() - started)
        store = self._store()
        there = {k.decode() for k in store.list().result()}
        writes = []
        nbytes = 0
        for key in owned:
            if key in there:
                continue
            data = (root / key).read_bytes()
            nbytes += len(data)
            writes.append(store.write(key, data))
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
