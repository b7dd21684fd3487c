"""Compilation-cache entries as kept where others may write, sealed with the job's cache key.

A cache entry is a program the trainer runs (JAX's entries are executables; a step-cache entry
is unpickled by `serialize_executable.deserialize_and_load`, which can run any code). In a
store that others can write (the checkpoint root, a gs:// bucket, a shared volume), an entry is
therefore loaded only if it carries a tag made with the job's secret key (the operator's
per-job Secret, `contract.ENV_CACHE_KEY`), which only the job's pods hold.

An entry in the shared store is

    MAGIC | tag (32 bytes) | payload

where `tag = HMAC-SHA256(key, DOMAIN | len(name) (8 bytes, big-endian) | name | payload)` and
`name` is the entry's key relative to the cache folder (`jit_step-...-cache`,
`tardigrade-step-cache/rank-1/<digest>.step`): an entry cannot be moved to another name (another
rank's folder, another program) without failing its check. The payload is the local file's
bytes, as JAX and step_cache.py write and read them.
"""

from __future__ import annotations

import hashlib
import hmac

from tardigrade_contract import contract

MAGIC = b"tardigrade-sealed-cache-entry 1\n"
DOMAIN = b"tardigrade compilation-cache entry\x00"
TAG_BYTES = hashlib.sha256().digest_size
# The operator's keys are 32 random bytes; a key a person types must not be guessable either.
MIN_KEY_BYTES = 16


class CacheKeyError(ValueError):
    """The contract's cache key cannot seal anything safely (a config error)."""


class UnauthenticatedEntryError(ValueError):
    """An entry that is not sealed with this job's key under its own name: never loaded."""


def job_key(text: str) -> bytes:
    """The HMAC key from the contract's cache key (`TARDIGRADE_CACHE_KEY`)."""
    key = text.encode()
    if len(key) < MIN_KEY_BYTES:
        raise CacheKeyError(
            f"{contract.ENV_CACHE_KEY} is {len(key)} bytes; a cache key needs at least "
            f"{MIN_KEY_BYTES} (the operator sets it from the job's Secret: unset the variable "
            "to run without a shared compilation cache, or set a random key of 32 bytes or more)")
    return key


def _tag(key: bytes, name: str, payload: bytes) -> bytes:
    encoded = name.encode()
    mac = hmac.new(key, DOMAIN, hashlib.sha256)
    mac.update(len(encoded).to_bytes(8, "big"))
    mac.update(encoded)
    mac.update(payload)
    return mac.digest()


def seal(key: bytes, name: str, payload: bytes) -> bytes:
    """The bytes to store under `name` in a shared store."""
    return MAGIC + _tag(key, name, payload) + payload


def unseal(key: bytes, name: str, sealed: bytes) -> bytes:
    """The payload of an entry stored under `name`; UnauthenticatedEntryError (saying why)
    unless it is sealed with `key` under that very name."""
    header = len(MAGIC) + TAG_BYTES
    if not sealed.startswith(MAGIC):
        raise UnauthenticatedEntryError("not a sealed entry (no tag: an unauthenticated or "
                                        "older-format entry)")
    if len(sealed) < header:
        raise UnauthenticatedEntryError(f"truncated ({len(sealed)} bytes, the header alone is "
                                        f"{header})")
    payload = sealed[header:]
    if not hmac.compare_digest(sealed[len(MAGIC):header], _tag(key, name, payload)):
        raise UnauthenticatedEntryError("wrong tag (not sealed with this job's key under this "
                                        "name, or altered)")
    return payload
