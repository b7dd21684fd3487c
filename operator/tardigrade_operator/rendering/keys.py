"""The job's keys: one Secret per TrainingJob, made by the operator, read by its pods.

The Secret holds the restart key (rank 0 accepts restart requests with it), the progress token
(rank 0 answers GET /progress to its bearer only) and the compilation-cache key (the trainer
authenticates cache entries with it). Pods get them through `secretKeyRef` (manifests.py), never as
literal values that whoever may read pods could read. The Secret is owned by the job, so
Kubernetes' garbage collector deletes it with the job.

The operator keeps the values it read or made in memory (`KeysCache`), per job uid: a Secret
deleted under a running gang is made again with the same values, so the running trainers'
keys stay valid; an operator that starts afresh makes new ones.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import secrets
from collections.abc import Mapping
from typing import Any

from tardigrade_contract import contract

from tardigrade_operator import naming
from tardigrade_operator.observation.pods import ServiceView
from tardigrade_operator.rendering.manifests import JobRef

# How long the operator trusts what it last read of a job's Secret before it asks again
# (whether it still exists, whether someone replaced its values). A refused request (401) asks
# at once.
RECHECK_SECONDS = 30.0
# The value of each key: 32 random bytes, URL-safe base64.
KEY_BYTES = 32


@dataclasses.dataclass(frozen=True)
class JobKeys:
    restart_key: str
    progress_token: str
    cache_key: str

    @classmethod
    def fresh(cls) -> JobKeys:
        return cls(secrets.token_urlsafe(KEY_BYTES), secrets.token_urlsafe(KEY_BYTES),
                   secrets.token_urlsafe(KEY_BYTES))

    def data(self) -> dict[str, str]:
        return {contract.SECRET_RESTART_KEY: self.restart_key,
                contract.SECRET_PROGRESS_TOKEN: self.progress_token,
                contract.SECRET_CACHE_KEY: self.cache_key}

    def __repr__(self) -> str:
        # Never in a log line or a traceback.
        return "JobKeys(<hidden>)"


def build_keys_secret(job: JobRef, keys: JobKeys) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": naming.keys_secret_name(job.name),
            "namespace": job.namespace,
            "labels": {naming.LABEL_MANAGED_BY: naming.MANAGED_BY, naming.LABEL_JOB: job.name},
            "ownerReferences": [job.owner_reference()],
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in keys.data().items()},
    }


def read_keys(secret: Mapping[str, Any]) -> JobKeys | None:
    """The keys in a Secret (API JSON), or None when one is missing, empty or not base64: such a
    Secret cannot serve the job's pods."""
    data = secret.get("data") or {}
    values = []
    for name in (contract.SECRET_RESTART_KEY, contract.SECRET_PROGRESS_TOKEN,
                 contract.SECRET_CACHE_KEY):
        raw = data.get(name)
        if not isinstance(raw, str):
            return None
        try:
            value = base64.b64decode(raw, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        if not value:
            return None
        values.append(value)
    return JobKeys(*values)


@dataclasses.dataclass
class KeysCache:
    """What the operator last read of one job's Secret (or made for it)."""

    uid: str
    checked: float  # the loop's monotonic time of the read
    found: ServiceView | None  # who owns the Secret of that name; None: there was none
    keys: JobKeys | None  # the values: read from our Secret, or those we made for it

    def due(self, uid: str, now: float) -> bool:
        return self.uid != uid or now - self.checked >= RECHECK_SECONDS
