"""The commit marker (`step_*/metadata.json`): what a committed checkpoint holds, as JSON.

Written last, by process 0, once every host's shards are durable: its presence is what makes
a step committed. Its fields are specified in docs/checkpoint-format.md.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tardigrade_checkpoint import digest, formatversion
from tardigrade_checkpoint.errors import CheckpointCorruptError
from tardigrade_checkpoint.lineage import LEGACY_LINEAGE, MarkerLine

# The format written; the ones read. Format 1 markers (no lineage, owner or attempt) belong to
# the first line of their root (docs/checkpoint-format.md).
FORMAT = "tardigrade-checkpoint/2"
READABLE_FORMATS = frozenset({"tardigrade-checkpoint/1", FORMAT})
# Fields older markers lack. Checkpoints from before digests were recorded have none: nothing
# to check; those from before the algorithm was recorded used SHA-256.
_OPTIONAL = frozenset({"digests", "digest_algorithm", "lineage", "attempt", "owner",
                       "all_chunks_stored"})


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    time: str
    process_count: int
    mesh: dict[str, int]
    arrays: dict[str, dict[str, Any]]
    extra: dict[str, Any]
    # leaf name -> shard region -> digest of the bytes written (see digest.py)
    digests: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    digest_algorithm: str = digest.LEGACY_ALGORITHM
    # The line it was committed on, and by which attempt of which job (None before format 2).
    lineage: str = LEGACY_LINEAGE
    attempt: int | None = None
    owner: dict[str, str] | None = None

    def line(self) -> MarkerLine:
        uid = self.owner.get("uid") if self.owner else None
        return MarkerLine(self.step, self.lineage, uid, self.attempt)
    # Every chunk is stored, fill-value ones too: a missing chunk is an error on restore.
    # (Markers from before this field omit it: their all-zero chunks may be absent.)
    all_chunks_stored: bool = False

    def to_json(self) -> str:
        payload = {"format": FORMAT, **dataclasses.asdict(self)}
        payload.pop("path")
        return json.dumps(payload, sort_keys=True, indent=1)


def parse(raw: bytes, step: int, path: str, where: str) -> CheckpointInfo:
    """The marker of checkpoint `step` at `path`, read from `where`; CheckpointCorruptError
    if it is not one."""
    try:
        data = json.loads(raw)
        if data.get("format") not in READABLE_FORMATS:
            raise ValueError(formatversion.why_unreadable(data.get("format"), READABLE_FORMATS))
        if data.get("step") != step:
            raise ValueError(f"unexpected format/step {data.get('format')}/{data.get('step')}")
        fields = {f.name for f in dataclasses.fields(CheckpointInfo)} - {"path"}
        info = CheckpointInfo(path=path,
                              **{k: data[k] for k in fields if k in data or k not in _OPTIONAL})
        digest.check_algorithm(info.digest_algorithm)
        return info
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointCorruptError(f"commit marker {where} is unreadable: {err}") from err
