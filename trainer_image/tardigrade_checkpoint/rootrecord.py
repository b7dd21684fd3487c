"""The root record: which job owns a checkpoint root, which attempt may commit, which line is
current. One small JSON object, `<root>/tardigrade-root.json`, written only by process 0 of a
starting gang and only as a compare-and-swap on the generation it read (TensorStore's
conditional write), so two gangs starting at once cannot both believe they won.
See docs/checkpoint-format.md.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

import tensorstore as ts

from tardigrade_checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointIOError,
    FencedError,
    ForeignRootError,
)
from tardigrade_checkpoint.lineage import LEGACY_LINEAGE, Branch, Fence

ROOT_FILE = "tardigrade-root.json"
ROOT_FORMAT = "tardigrade-root/1"


@dataclasses.dataclass(frozen=True)
class JobIdentity:
    """The TrainingJob a gang runs for. A re-created job keeps namespace and name, not uid."""

    namespace: str
    name: str
    uid: str = ""

    def describe(self) -> str:
        return f"TrainingJob {self.namespace}/{self.name} (uid {self.uid or 'unset'})"

    def same_name(self, other: JobIdentity) -> bool:
        return (self.namespace, self.name) == (other.namespace, other.name)


@dataclasses.dataclass(frozen=True)
class RootRecord:
    owner: JobIdentity
    attempt: int  # the newest attempt of `owner` that started on this root
    base_step: int  # the newest step of the current line when that attempt started (-1: none)
    lineage: str  # the current branch
    branches: dict[str, Branch]
    previous_owners: tuple[JobIdentity, ...] = ()

    @property
    def fence(self) -> Fence:
        return Fence(self.owner.uid, self.attempt, self.base_step)

    def has_request(self, request: str) -> bool:
        return any(b.request == request for b in self.branches.values())

    def to_json(self) -> str:
        return json.dumps({"format": ROOT_FORMAT, **dataclasses.asdict(self)}, sort_keys=True,
                          indent=1)

    @classmethod
    def from_json(cls, text: bytes, where: str) -> RootRecord:
        try:
            data = json.loads(text)
            if data.get("format") != ROOT_FORMAT:
                raise ValueError(f"unknown format {data.get('format')!r}")
            return cls(
                owner=JobIdentity(**data["owner"]),
                attempt=int(data["attempt"]),
                base_step=int(data["base_step"]),
                lineage=str(data["lineage"]),
                branches={k: Branch(**v) for k, v in data["branches"].items()},
                previous_owners=tuple(JobIdentity(**o) for o in data.get("previous_owners", ())),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointCorruptError(f"root record {where} is unreadable: {err}") from err


def take_over(record: RootRecord | None, me: JobIdentity, attempt: int, newest: int,
              root: str) -> RootRecord:
    """The record once attempt `attempt` of `me` has started on the root.

    `newest` is the newest step of the current line under `record` (-1: none). A root without
    a record (new, or written before format 2) is claimed. The same job (namespace, name,
    uid) moves the fence to its attempt. The same namespace/name with a new uid is the job
    deleted and re-applied: Kubernetes names are unique, so the previous owner no longer
    exists and the new job adopts the root and continues its line; the old uid is fenced off
    for good. Any other job is refused.
    """
    if record is None:
        return RootRecord(owner=me, attempt=attempt, base_step=newest, lineage=LEGACY_LINEAGE,
                          branches={LEGACY_LINEAGE: Branch()})
    owner = record.owner
    if any(me.uid == old.uid for old in record.previous_owners if me.same_name(old)):
        raise FencedError(
            f"{me.describe()} was deleted and re-created; the new job owns checkpoint root "
            f"{root} now, so this gang of the deleted one must stop")
    if not me.same_name(owner):
        raise ForeignRootError(
            f"checkpoint root {root} belongs to {owner.describe()}, not to {me.describe()}: "
            "jobs sharing a root would delete and overwrite each other's checkpoints. Give this "
            f"job its own spec.checkpoint.path; to start from that job's weights, set "
            f"spec.checkpoint.initFrom.path: {root} (read only); if that job is gone for good "
            f"and this one should take its checkpoints over, delete {root}/{ROOT_FILE}")
    if me.uid != owner.uid:
        return dataclasses.replace(record, owner=me, attempt=attempt, base_step=newest,
                                   previous_owners=(*record.previous_owners, owner))
    if attempt < record.attempt:
        raise FencedError(
            f"attempt {record.attempt} of {me.describe()} started on checkpoint root {root} "
            f"after this gang (attempt {attempt}): this gang is stale and must not commit")
    return dataclasses.replace(record, attempt=attempt, base_step=newest)


def fork(record: RootRecord, parent: str | None, step: int | None,
         request: str | None) -> RootRecord:
    """A new current line starting from `step` of line `parent` (None: from nothing)."""
    name = uuid.uuid4().hex[:16]
    branches = {**record.branches, name: Branch(parent, step, request)}
    return dataclasses.replace(record, lineage=name, branches=branches,
                               base_step=-1 if step is None else step)


def check_fence(record: RootRecord | None, me: JobIdentity, attempt: int, root: str) -> None:
    """Before a commit: refuse it when a newer attempt or a re-created job took the root."""
    if record is None:
        raise FencedError(f"the root record of {root} is gone: this gang no longer owns the root")
    if record.owner != me or record.attempt > attempt:
        raise FencedError(
            f"{record.owner.describe()} attempt {record.attempt} took checkpoint root {root} "
            f"over from this gang ({me.describe()} attempt {attempt}): commit refused")


def load(kv: ts.KvStore, root: str) -> tuple[RootRecord | None, Any]:
    """(record or None, the storage generation it was read at, for `store`)."""
    try:
        result = kv.read(ROOT_FILE).result()
    except Exception as err:
        raise CheckpointIOError(f"cannot read {root}/{ROOT_FILE}: {err}") from err
    if result.state != "value":
        return None, result.stamp.generation
    return (RootRecord.from_json(bytes(result.value), f"{root}/{ROOT_FILE}"),
            result.stamp.generation)


def store(kv: ts.KvStore, record: RootRecord, generation: Any, root: str) -> bool:
    """Replace the record if nobody wrote it since `generation` was read; False if they did.

    A refusal can be this very write: TensorStore's GCS driver retries a write whose answer
    was lost (a 5xx, a connection closed before the answer) with the same
    `ifGenerationMatch`, and when the first try had landed, GCS answers the retry 412, which
    TensorStore reports as a failed condition. So a refused write reads the record back: if
    the stored bytes are the ones written here, the write took effect and it was this one
    (a rival writes another attempt, another branch id), so it counts as done; anything else
    is a rival's write, and the caller starts again from a fresh read.
    """
    data = record.to_json().encode()
    try:
        written = kv.write(ROOT_FILE, data, if_equal=generation).result()
        if written.generation:
            return True
        stored = kv.read(ROOT_FILE).result()  # an empty generation: the condition failed
    except Exception as err:
        raise CheckpointIOError(f"cannot write {root}/{ROOT_FILE}: {err}") from err
    return stored.state == "value" and bytes(stored.value) == data
