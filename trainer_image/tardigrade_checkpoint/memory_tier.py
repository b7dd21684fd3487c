"""The memory tier: each host's own shards of a step, kept in host memory and on a peer.

A bucket save every N steps loses up to N steps to a host lost without notice. The memory tier
snapshots every `interval` steps into a directory that outlives the trainer's container (the
pod's `emptyDir` with `medium: Memory`, a tmpfs) and sends a copy to `replicas` other ranks,
which keep it in theirs. A relaunch that keeps the surviving pods (restart in place) finds
each lost rank's shards on a peer. The design and its costs: docs/memory-tier.md.

Layout under a memory directory (one per host):

    tardigrade-memory/owner_00003/step_00000015/data.bin      the owner's pieces, raw
    tardigrade-memory/owner_00003/step_00000015/manifest      the commit marker, written last

A holder keeps its own snapshot and its replicas the same way, under the owner's number. The
manifest is sealed (HMAC-SHA256 under the job's replica key, `seal`), so that a peer's bytes
are never trusted on its word, and it names every piece's region, place in `data.bin` and
digest. A piece is one addressable shard of a leaf, deduplicated by region (a replicated leaf
is stored whole by every owner: a host restores from its own memory alone). A snapshot
without its manifest is partial: never listed, removed when the same step is written again or
by retention.

What is pure here (the selection rules, `select`) is table- and property-tested; the rest
reads and writes files and device arrays.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import hmac
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tardigrade_checkpoint import digest

if TYPE_CHECKING:  # staging imports jax, which this module imports only where it uses it
    from tardigrade_checkpoint import staging

FORMAT = "tardigrade-memory/1"
ROOT = "tardigrade-memory"
MANIFEST = "manifest"
DATA = "data.bin"
# Peers are outside the bucket's trust boundary: a cryptographic hash, not XXH3 (digest.py).
ALGORITHM = "sha256-128"
SEAL_DOMAIN = b"tardigrade memory-tier manifest\x00"
SEAL_HEX = 64
DEFAULT_KEEP = 2
MIN_KEY_BYTES = 16
_OWNER_DIR = re.compile(r"^owner_(\d{5,})$")
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class MemoryTierError(RuntimeError):
    """A memory snapshot cannot be used (missing, unauthenticated, damaged, or for another
    mesh): the gang restores from the bucket instead."""


# --- the snapshot ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Piece:
    leaf: str
    region: str  # digest.region_key of the piece in the whole array
    dtype: str
    shape: tuple[int, ...]  # the piece's own shape
    # The host copy: numpy data, or (an accelerator's) a copy staged in device memory that
    # the device reader brings to the host (staging.StagedShard; `np.asarray` waits for it).
    value: Any = None


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One owner's pieces of one step, on the host (or staged on its devices)."""

    arrays: dict[str, dict[str, Any]]  # leaf -> {"shape", "dtype"[, "prng_impl"]}
    pieces: list[Piece]

    @property
    def nbytes(self) -> int:
        return sum(int(p.value.nbytes) for p in self.pieces if p.value is not None)

    def release(self) -> None:
        """Give back the device memory of pieces still staged (a commit that failed before
        reading them); read ones gave it back already."""
        from tardigrade_checkpoint import staging

        for piece in self.pieces:
            if isinstance(piece.value, staging.StagedShard):
                piece.value.release()


def take_snapshot(state: Any, budget: staging.Budget | None = None,
                  report: staging.StagingReport | None = None) -> Snapshot:
    """Copy this host's shards of `state` off its devices (the loop waits for this part only).

    Every addressable shard once per region; host values whole. Copies, not views: the
    training step donates the state's buffers.

    `budget` (staging.DeviceBudget, the bucket save's): off the CPU, the shards that fit it
    are staged in spare device memory (the loop waits only for the device-side copy) and
    read to the host by the device reader while the loop trains on; the rest are copied to
    the host here (staging.py). None, or on the CPU: every shard copied to the host here.
    `report` (staging.StagingReport) is told what was staged."""
    from tardigrade_checkpoint import staging

    arrays, pieces, at, shards = _plan(state)
    if budget is None or _on_cpu([device for device, _ in shards]):
        # CPU "device" memory is host memory, and `np.asarray` of it may be a view of the
        # buffer the next step donates: a copy of its own, now.
        got: dict[int, Any] = {i: np.asarray(data).copy() for i, (_, data) in enumerate(shards)}
    else:
        got = staging.stage(shards, budget, report)
    for i, position in enumerate(at):
        pieces[position] = dataclasses.replace(pieces[position], value=got[i])
    return Snapshot(arrays, pieces)


def prepare(state: Any, budget: staging.Budget) -> None:
    """Start compiling the staged copy's program for snapshots of `state`'s layout
    (staging.prepare), so that the first one need not copy the slower way. Nothing to do on
    the CPU."""
    from tardigrade_checkpoint import staging

    shards = _plan(state)[3]
    if not _on_cpu([device for device, _ in shards]):
        staging.prepare(shards, budget)


def _plan(state: Any) -> tuple[dict[str, dict[str, Any]], list[Piece], list[int],
                               list[tuple[Any, Any]]]:
    """(the leaves' entries, the pieces with host values filled in, where each device piece
    is among them, the device pieces' (device, single-device array))."""
    import jax

    from tardigrade_checkpoint import layout, leaves

    names = layout.leaf_names(state)
    arrays: dict[str, dict[str, Any]] = {}
    pieces: list[Piece] = []
    at: list[int] = []
    shards: list[tuple[Any, Any]] = []
    for name, leaf in zip(names, jax.tree_util.tree_leaves(state), strict=True):
        entry: dict[str, Any] = {}
        if leaves.is_prng_key(leaf):
            entry["prng_impl"] = leaves.key_impl(leaf)
            leaf = jax.random.key_data(leaf)
        if leaves.is_host_value(leaf):
            value = np.array(leaf, copy=True)
            arrays[name] = {"shape": list(value.shape), "dtype": value.dtype.name, **entry}
            pieces.append(Piece(name, _whole(value.shape), value.dtype.name,
                                tuple(value.shape), value))
            continue
        shape = tuple(leaf.shape)
        dtype = np.dtype(leaf.dtype).name
        arrays[name] = {"shape": list(shape), "dtype": dtype, **entry}
        seen: set[str] = set()
        for shard in leaf.addressable_shards:
            region = digest.region_key(shard.index, shape)
            if region in seen:
                continue
            seen.add(region)
            data = shard.data
            at.append(len(pieces))
            pieces.append(Piece(name, region, dtype, tuple(data.shape)))
            shards.append((shard.device, data))
    return arrays, pieces, at, shards


def _on_cpu(devices: Sequence[Any]) -> bool:
    """Whether the shards are in host memory already (the CPU backend): nothing to stage."""
    return all(device.platform == "cpu" for device in devices)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The commit marker of one owner's snapshot of one step (sealed on disk and on the wire)."""

    step: int
    attempt: int
    owner: int
    process_count: int
    lineage: str
    job_uid: str
    arrays: dict[str, dict[str, Any]]
    pieces: list[dict[str, Any]]  # leaf, region, dtype, shape, offset, nbytes, digest
    data_bytes: int
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    # A random id of the gang's launch, the same on every rank: two launches of one attempt
    # (a trainer run outside the operator keeps attempt 0) never pass for one snapshot.
    launch: str = ""
    format: str = FORMAT

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        try:
            data = json.loads(raw)
            if data.get("format") != FORMAT:
                raise MemoryTierError(f"manifest format {data.get('format')!r}, this trainer "
                                      f"reads {FORMAT}")
            fields = {f.name for f in dataclasses.fields(cls)}
            manifest = cls(**{k: v for k, v in data.items() if k in fields})
        except (ValueError, TypeError, AttributeError) as err:
            raise MemoryTierError(f"manifest is unreadable: {err}") from None
        for name in ("step", "attempt", "owner", "process_count", "data_bytes"):
            if not isinstance(getattr(manifest, name), int):
                raise MemoryTierError(f"manifest field {name} is not an integer")
        return manifest


def encode(snapshot: Snapshot, *, step: int, attempt: int, owner: int, process_count: int,
           lineage: str, job_uid: str, extra: Mapping[str, Any] | None = None,
           mesh: Mapping[str, int] | None = None, launch: str = ""
           ) -> tuple[Manifest, list[np.ndarray]]:
    """The manifest (with every piece's digest and place) and the buffers of `data.bin`, one
    piece after the other on the calling thread (`commit` spreads the same work over
    threads)."""
    entries = layout(snapshot)
    buffers = []
    for entry, piece in zip(entries, snapshot.pieces, strict=True):
        value = _host_value(piece, entry)
        entry["digest"] = digest.digest_array(value, ALGORITHM)
        buffers.append(_as_bytes(value))
    return _manifest(snapshot, entries, step=step, attempt=attempt, owner=owner,
                     process_count=process_count, lineage=lineage, job_uid=job_uid,
                     extra=extra, mesh=mesh, launch=launch), buffers


def layout(snapshot: Snapshot) -> list[dict[str, Any]]:
    """Each piece's manifest entry but its digest: its place in `data.bin` is known before
    any staged piece reaches the host (a staged copy knows its size)."""
    entries, offset = [], 0
    for piece in snapshot.pieces:
        assert piece.value is not None
        nbytes = int(piece.value.nbytes)
        entries.append({"leaf": piece.leaf, "region": piece.region, "dtype": piece.dtype,
                        "shape": list(piece.shape), "offset": offset, "nbytes": nbytes})
        offset += nbytes
    return entries


def _host_value(piece: Piece, entry: Mapping[str, Any]) -> np.ndarray:
    """The piece in host memory, contiguous (a staged one: once the device reader has read
    it)."""
    value = np.ascontiguousarray(piece.value)
    if int(value.nbytes) != entry["nbytes"]:
        raise MemoryTierError(f"piece {piece.leaf}[{piece.region}] is {value.nbytes} bytes "
                              f"on the host, {entry['nbytes']} staged")
    return value


def _as_bytes(value: np.ndarray) -> np.ndarray:
    # As bytes through a uint8 view: bfloat16 & co. have no buffer protocol.
    return value.reshape(-1).view(np.uint8)


def _manifest(snapshot: Snapshot, entries: list[dict[str, Any]], *, step: int, attempt: int,
              owner: int, process_count: int, lineage: str, job_uid: str,
              extra: Mapping[str, Any] | None, mesh: Mapping[str, int] | None,
              launch: str) -> Manifest:
    return Manifest(step=step, attempt=attempt, owner=owner, process_count=process_count,
                    lineage=lineage, job_uid=job_uid, arrays=snapshot.arrays, pieces=entries,
                    data_bytes=sum(e["nbytes"] for e in entries), extra=dict(extra or {}),
                    mesh=dict(mesh or {}), launch=launch)


@dataclasses.dataclass
class CommitTimes:
    """Where one commit's time went. The phases overlap (each piece is digested and written
    as soon as it is on the host, several at once): `read_s`, `digest_s` and `write_s` are
    summed over the workers, `seconds` is the commit's wall time."""

    read_s: float = 0.0  # waiting for staged pieces to reach host memory
    digest_s: float = 0.0
    write_s: float = 0.0
    seal_s: float = 0.0  # the manifest sealed, written and renamed, older snapshots dropped
    seconds: float = 0.0
    workers: int = 1

    def to_json(self) -> dict[str, float | int]:
        return {k: round(v, 6) if isinstance(v, float) else v
                for k, v in dataclasses.asdict(self).items()}


def commit(store: MemoryStore, snapshot: Snapshot, workers: concurrent.futures.Executor,
           worker_count: int = 1, *, step: int, attempt: int, owner: int, process_count: int,
           lineage: str, job_uid: str, extra: Mapping[str, Any] | None = None,
           mesh: Mapping[str, int] | None = None, launch: str = ""
           ) -> tuple[bytes, list[np.ndarray], CommitTimes]:
    """Commit this owner's snapshot into `store`: (the sealed manifest, the pieces' host
    bytes, where the time went).

    Each piece is read (a staged one: its device read waited for), digested and written at
    its offset in `data.bin` by one task on `workers`, the pieces taken in the order the
    device reader reads them, so that the digests and writes of the first run beside the
    reads of the next ones. SHA-256 and `os.pwrite` release the GIL on large buffers. The
    manifest, the commit marker, is written only once every piece's write has returned, with
    the digests `check_data` checks on a restore. A failed piece fails the commit (after
    every task has ended: none writes after it returns), and leaves a partial snapshot,
    never listed."""
    times = CommitTimes(workers=worker_count)
    started = time.perf_counter()
    entries = layout(snapshot)
    data_bytes = sum(e["nbytes"] for e in entries)
    where, fd = store.open_data(owner, step, data_bytes)
    buffers: list[np.ndarray | None] = [None] * len(entries)
    try:
        def one(i: int) -> tuple[float, float, float]:
            t0 = time.perf_counter()
            value = _host_value(snapshot.pieces[i], entries[i])
            t1 = time.perf_counter()
            entries[i]["digest"] = digest.digest_array(value, ALGORITHM)
            t2 = time.perf_counter()
            data = _as_bytes(value)
            _pwrite_all(fd, memoryview(data), entries[i]["offset"])
            buffers[i] = data
            return t1 - t0, t2 - t1, time.perf_counter() - t2

        tasks = [workers.submit(one, i) for i in _read_order(snapshot)]
        concurrent.futures.wait(tasks, return_when=concurrent.futures.FIRST_EXCEPTION)
        failed = [t for t in tasks if t.done() and t.exception() is not None]
        if failed:
            for task in tasks:
                task.cancel()
            concurrent.futures.wait(tasks)
            raise failed[0].exception()  # type: ignore[misc]
        for task in tasks:
            read_s, digest_s, write_s = task.result()
            times.read_s += read_s
            times.digest_s += digest_s
            times.write_s += write_s
    finally:
        os.close(fd)
    sealing = time.perf_counter()
    sealed = seal(store.key, _manifest(snapshot, entries, step=step, attempt=attempt,
                                       owner=owner, process_count=process_count,
                                       lineage=lineage, job_uid=job_uid, extra=extra,
                                       mesh=mesh, launch=launch))
    store.seal_commit(where, owner, sealed)
    done = time.perf_counter()
    times.seal_s, times.seconds = done - sealing, done - started
    return sealed, [b for b in buffers if b is not None], times


def _read_order(snapshot: Snapshot) -> list[int]:
    """The pieces' positions: host values first (already there), then staged ones in the
    order the device reader takes them."""
    return sorted(range(len(snapshot.pieces)),
                  key=lambda i: getattr(snapshot.pieces[i].value, "read_order", -1))


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def check_key(key: bytes, variable: str) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise MemoryTierError(f"{variable} is {len(key)} bytes; the replica key needs at least "
                              f"{MIN_KEY_BYTES} (the operator sets it from the job's Secret)")
    return key


def derived_keys(key: bytes) -> tuple[bytes, str]:
    """(seal key, bearer token) from the job's replica key, each for its one use: the key
    itself never crosses the network (the pod network is plain HTTP), and a token seen there
    seals nothing."""
    def derive(label: bytes) -> bytes:
        return hmac.new(key, b"tardigrade memory tier\x00" + label, hashlib.sha256).digest()

    return derive(b"seal"), derive(b"bearer").hex()


def seal(key: bytes, manifest: Manifest) -> bytes:
    """`<HMAC-SHA256 hex>\\n<manifest JSON>`: what is stored and sent."""
    body = manifest.to_json()
    tag = hmac.new(key, SEAL_DOMAIN + body, hashlib.sha256).hexdigest()
    return tag.encode() + b"\n" + body


def unseal(key: bytes, sealed: bytes) -> Manifest:
    """The manifest, if sealed with `key`; MemoryTierError otherwise."""
    tag, _, body = sealed.partition(b"\n")
    if len(tag) != SEAL_HEX:
        raise MemoryTierError("manifest is not sealed")
    expected = hmac.new(key, SEAL_DOMAIN + body, hashlib.sha256).hexdigest().encode()
    if not hmac.compare_digest(tag, expected):
        raise MemoryTierError("manifest seal does not match the job's replica key (altered, "
                              "or written by another job)")
    return Manifest.from_json(body)


def check_data(manifest: Manifest, data: bytes | memoryview) -> None:
    """Every piece's bytes against the manifest's digest; MemoryTierError names the first bad
    one."""
    if len(data) != manifest.data_bytes:
        raise MemoryTierError(f"owner {manifest.owner} step {manifest.step}: data is "
                              f"{len(data)} bytes, the manifest says {manifest.data_bytes}")
    for entry in manifest.pieces:
        value = _piece_value(entry, data)
        if digest.digest_array(value, ALGORITHM) != entry["digest"]:
            raise MemoryTierError(f"owner {manifest.owner} step {manifest.step}: piece "
                                  f"{entry['leaf']}[{entry['region']}] does not match its "
                                  "digest")


def _piece_value(entry: Mapping[str, Any], data: bytes | memoryview) -> np.ndarray:
    """The piece's values as stored (a view of `data`)."""
    import jax.numpy as jnp

    start, size = int(entry["offset"]), int(entry["nbytes"])
    if start < 0 or size < 0 or start + size > len(data):
        raise MemoryTierError(f"piece {entry.get('leaf')} lies outside the data")
    dtype = np.dtype(jnp.dtype(entry["dtype"]))
    shape = tuple(int(n) for n in entry["shape"])
    if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != size:
        raise MemoryTierError(f"piece {entry.get('leaf')}: {size} bytes do not hold "
                              f"{dtype.name}{list(shape)}")
    return np.frombuffer(data, dtype=dtype, count=size // dtype.itemsize if dtype.itemsize
                         else 0, offset=start).reshape(shape)


# --- one host's memory directory ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Held:
    """One committed snapshot a host holds: whose, which step, written by which launch."""

    owner: int
    step: int
    attempt: int
    process_count: int
    lineage: str
    launch: str = ""

    def to_json(self) -> list[Any]:
        return [self.owner, self.step, self.attempt, self.process_count, self.lineage,
                self.launch]

    @classmethod
    def from_json(cls, value: Sequence[Any]) -> Held:
        owner, step, attempt, count, lineage, launch = value
        return cls(int(owner), int(step), int(attempt), int(count), str(lineage), str(launch))


class MemoryStore:
    """A host's memory directory: its own snapshots and the replicas it holds for peers."""

    def __init__(self, directory: str | os.PathLike[str], key: bytes,
                 keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(directory) / ROOT
        self.key = key
        self.keep = keep

    def _step_dir(self, owner: int, step: int) -> Path:
        return self.root / f"owner_{owner:05d}" / f"step_{step:08d}"

    def write(self, sealed: bytes, buffers: Iterable[bytes | np.ndarray | memoryview]) -> None:
        """Commit one snapshot: data first, the manifest last (a rename), then drop the
        owner's older snapshots beyond `keep`. The manifest is checked before anything is
        written (a peer's upload is untrusted)."""
        manifest = unseal(self.key, sealed)
        where, fd = self.open_data(manifest.owner, manifest.step, manifest.data_bytes)
        with os.fdopen(fd, "wb") as out:
            for buffer in buffers:
                out.write(memoryview(buffer).cast("B"))
        self.seal_commit(where, manifest.owner, sealed)

    def open_data(self, owner: int, step: int, nbytes: int) -> tuple[Path, int]:
        """(the step's directory, a descriptor of its new `data.bin`, `nbytes` long) after
        removing a stale snapshot of the same step: the data of a commit, written before its
        manifest (`seal_commit`)."""
        where = self._step_dir(owner, step)
        self.remove(owner, step)  # a stale one of the same step, if any
        where.mkdir(parents=True, exist_ok=True)
        fd = os.open(where / DATA, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            os.ftruncate(fd, nbytes)
        except OSError:
            os.close(fd)
            raise
        return where, fd

    def seal_commit(self, where: Path, owner: int, sealed: bytes) -> None:
        """The commit marker, once all of `data.bin` is written: the manifest (a rename),
        then the owner's older snapshots beyond `keep` are dropped."""
        partial = where / (MANIFEST + ".partial")
        partial.write_bytes(sealed)
        os.replace(partial, where / MANIFEST)
        self._retain(owner)

    def remove(self, owner: int, step: int) -> None:
        """Manifest first: a half-removed snapshot is a partial one, never a torn one."""
        where = self._step_dir(owner, step)
        (where / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(where, ignore_errors=True)

    def _retain(self, owner: int) -> None:
        """Keep the owner's newest `keep` committed snapshots; drop older ones and partial
        ones older than the newest commit."""
        committed = [step for step in self._steps(owner)
                     if (self._step_dir(owner, step) / MANIFEST).exists()]
        kept = committed[-self.keep:]
        for step in self._steps(owner):
            if step not in kept and kept and step < kept[-1]:
                self.remove(owner, step)

    def _owners(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir()
                      if (m := _OWNER_DIR.match(p.name)))

    def _steps(self, owner: int) -> list[int]:
        where = self.root / f"owner_{owner:05d}"
        if not where.is_dir():
            return []
        return sorted(int(m.group(1)) for p in where.iterdir() if (m := _STEP_DIR.match(p.name)))

    def read_manifest(self, owner: int, step: int) -> bytes:
        """The sealed manifest of a committed snapshot (unchecked); MemoryTierError if absent."""
        try:
            return (self._step_dir(owner, step) / MANIFEST).read_bytes()
        except OSError as err:
            raise MemoryTierError(f"owner {owner} step {step} is not held here: {err}") from None

    def read(self, owner: int, step: int) -> tuple[bytes, bytes]:
        """(sealed manifest, data) of a committed snapshot; MemoryTierError if absent."""
        where = self._step_dir(owner, step)
        try:
            return (where / MANIFEST).read_bytes(), (where / DATA).read_bytes()
        except OSError as err:
            raise MemoryTierError(f"owner {owner} step {step} is not held here: {err}") from None

    def load(self, owner: int, step: int) -> tuple[Manifest, bytes]:
        """A committed snapshot, its seal and every piece checked."""
        sealed, data = self.read(owner, step)
        manifest = unseal(self.key, sealed)
        if (manifest.owner, manifest.step) != (owner, step):
            raise MemoryTierError(f"owner_{owner}/step_{step} holds owner {manifest.owner} "
                                  f"step {manifest.step}")
        check_data(manifest, data)
        return manifest, data

    def inventory(self) -> list[Held]:
        """Every committed snapshot held here whose manifest is sealed with the job's key
        (pieces are checked when read, not here: a listing must stay cheap)."""
        held = []
        for owner in self._owners():
            for step in self._steps(owner):
                path = self._step_dir(owner, step) / MANIFEST
                try:
                    manifest = unseal(self.key, path.read_bytes())
                except (OSError, MemoryTierError):
                    continue
                if (manifest.owner, manifest.step) == (owner, step):
                    held.append(Held(owner, step, manifest.attempt, manifest.process_count,
                                     manifest.lineage, manifest.launch))
        return held


# --- the gang's choice (pure) ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Selection:
    """The memory step the gang restores, the size of the gang that wrote it, and for each of
    that gang's owners the rank whose memory holds its pieces (the owner itself where it
    can)."""

    step: int
    attempt: int
    sources: tuple[int, ...]  # index: owner rank; value: holder rank
    launch: str = ""

    @property
    def process_count(self) -> int:
        """How many processes wrote the snapshot (one owner each)."""
        return len(self.sources)

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "attempt": self.attempt,
                           "sources": list(self.sources), "launch": self.launch})

    @classmethod
    def from_json(cls, text: str) -> Selection | None:
        data = json.loads(text) if text else None
        if not data:
            return None
        return cls(int(data["step"]), int(data["attempt"]),
                   tuple(int(s) for s in data["sources"]), str(data["launch"]))


def select(held: Mapping[int, Iterable[Held]], lineage: str, floor: int) -> Selection | None:
    """The newest memory snapshot that is complete across the gang that wrote it, if it is at
    least `floor` (the bucket's newest committed step of the current line; -1: none).

    Complete: for every owner 0..N-1 of the gang of N processes that wrote it, some rank
    holds that owner's snapshot of the same step, written by the same launch of the same
    attempt (a step re-trained by a later one is another state) and on the current line.
    Anything less is a torn step and never chosen. Ties go to the newer attempt. The gang
    restoring it may have another size (`assemble` reshards)."""
    copies: dict[tuple[int, int, str, int], dict[int, list[int]]] = {}
    for holder, items in held.items():
        for item in items:
            if item.lineage != lineage or not 0 <= item.owner < item.process_count:
                continue
            key = (item.step, item.attempt, item.launch, item.process_count)
            copies.setdefault(key, {}).setdefault(item.owner, []).append(holder)
    for step, attempt, launch, count in sorted(copies, reverse=True):
        if step < floor:
            return None
        owners = copies[(step, attempt, launch, count)]
        if len(owners) < count:
            continue
        sources = tuple(owner if owner in owners[owner] else min(owners[owner])
                        for owner in range(count))
        return Selection(step, attempt, sources, launch)
    return None


def holders(owner: int, process_count: int, replicas: int) -> list[int]:
    """The ranks that keep `owner`'s replicas: the next ones on the ring. With one rank per
    pod, and pods of a gang on distinct nodes, they are on other nodes than the owner."""
    return [(owner + k) % process_count for k in range(1, min(replicas, process_count - 1) + 1)]


# --- restoring --------------------------------------------------------------------------------
def wanted_regions(target: Any) -> dict[str, list[tuple[slice, ...]]]:
    """Leaf name -> the regions the target puts on this host's devices (a host value: all
    of it)."""
    import jax

    from tardigrade_checkpoint import layout, leaves

    wanted: dict[str, list[tuple[slice, ...]]] = {}
    for name, leaf in zip(layout.leaf_names(target), jax.tree_util.tree_leaves(target),
                          strict=True):
        read = leaves.read_target(name, leaf)
        if read.sharding is None:
            wanted[name] = [tuple(slice(0, n) for n in read.shape)]
            continue
        wanted[name] = [tuple(slice(*part.indices(n)[:2]) for part, n in
                              zip(index, read.shape, strict=True))
                        for index in read.sharding.addressable_devices_indices_map(
                            read.shape).values()]
    return wanted


def owners_needed(manifests: Mapping[int, Manifest],
                  wanted: Mapping[str, Sequence[tuple[slice, ...]]],
                  prefer: Iterable[int] = ()) -> list[int]:
    """Owners whose pieces together hold every region this host restores: each piece
    overlapping a wanted region comes from an owner already chosen if one has it, else from
    one in `prefer` (held in this host's memory), else the lowest. Replicated leaves are held
    whole by every owner: they do not make every owner's data worth fetching."""
    holders: dict[tuple[str, str], list[int]] = {}
    for owner, manifest in sorted(manifests.items()):
        for entry in manifest.pieces:
            holders.setdefault((entry["leaf"], entry["region"]), []).append(owner)
    preferred = set(prefer)
    chosen: list[int] = []
    for (leaf, region), owners in sorted(holders.items()):
        box = digest.parse_region(region)
        if not any(_overlaps(box, want) for want in wanted.get(leaf, ())):
            continue
        if any(owner in chosen for owner in owners):
            continue
        chosen.append(min(owners, key=lambda o: (o not in preferred, o)))
    return sorted(chosen)


def _overlaps(a: tuple[slice, ...], b: tuple[slice, ...]) -> bool:
    """Regions of one array that share an element (an empty dimension counts as shared:
    a zero-size leaf's one piece must still be read)."""
    return all(max(x.start, y.start) < min(x.stop, y.stop) or x.start == x.stop
               for x, y in zip(a, b, strict=True))


def assemble(parts: Sequence[tuple[Manifest, bytes | memoryview]], target: Any) -> Any:
    """The state of `target`'s structure, shapes and shardings from the pieces of one or more
    owners of one snapshot (this host's own, peers' replicas). A region the target puts on
    this host's devices is a stored piece, or is cut from the pieces that tile it (another
    mesh: the gang that wrote the snapshot saved one global sharding, so the owners' pieces
    of a leaf are equal or disjoint); one not covered raises MemoryTierError."""
    import jax

    from tardigrade_checkpoint import layout, leaves

    by_region: dict[tuple[str, str], tuple[Mapping[str, Any], bytes | memoryview]] = {}
    for manifest, data in parts:
        for entry in manifest.pieces:
            by_region.setdefault((entry["leaf"], entry["region"]), (entry, data))
    regions_of: dict[str, dict[str, str]] = {}
    for leaf_name, region in by_region:
        regions_of.setdefault(leaf_name, {})[region] = ""
    names = layout.leaf_names(target)
    flat, treedef = jax.tree_util.tree_flatten(target)
    out = []
    for name, leaf in zip(names, flat, strict=True):
        read = leaves.read_target(name, leaf)
        for manifest, _ in parts:
            recorded = manifest.arrays.get(name)
            if recorded != read.recorded():
                raise MemoryTierError(f"leaf {name}: stored {recorded}, the target wants "
                                      f"{read.recorded()}")

        def piece(index: Any, name: str = name, read: Any = read) -> np.ndarray:
            shape = read.shape
            region = digest.region_key(index, shape)
            found = by_region.get((name, region))
            if found is not None:
                return np.array(_piece_value(*found))
            box = digest.parse_region(region)
            try:
                plan = digest.plan_pieces(box, regions_of.get(name, {}))
            except ValueError as err:
                raise MemoryTierError(f"leaf {name}: region [{region}] is not covered by "
                                      f"the snapshot's pieces: {err}") from None
            buffer = np.empty(tuple(b.stop - b.start for b in box), dtype=read.dtype)
            for part in plan:
                value = _piece_value(*by_region[(name, part.key)])
                overlap = part.overlap(box)
                buffer[digest.local(overlap, box)] = value[digest.local(overlap, part.region)]
            return buffer

        if read.sharding is None:
            stored: Any = piece(tuple(slice(0, n) for n in read.shape))
        else:
            stored = jax.make_array_from_callback(read.shape, read.sharding, piece)
        out.append(read.finish(stored))
    return jax.tree_util.tree_unflatten(treedef, out)


def _whole(shape: Sequence[int]) -> str:
    return digest.region_key(tuple(slice(0, n) for n in shape), shape)
