"""Start-up check that every host of the gang sees the same checkpoint root.

A local path that is private to a pod or a node (an emptyDir or hostPath volume, a node's own
disk) takes every host's shards and process 0's commit marker without complaint, and then no
gang can restore it: each host finds only what it wrote itself. So before the first save or
restore every host writes a small probe file under the root and must read every other
host's; otherwise the job stops with a configuration error that says how to fix it.

1. The hosts agree on a token for this start (process 0's, through the coordination service).
2. Each host writes `.tardigrade-shared-probe-<token>-<process>` under the root.
3. After a barrier, each host reads every other host's probe, retrying a missing one for a
   bounded time: NFS clients cache lookups, failed ones included, for a few seconds.
4. The hosts exchange what each of them saw, so they all reach the same verdict (a root can
   be shared by some hosts and not others) and report the same error.
5. Each host deletes its own probe, the one file it surely can reach; process 0 also
   removes probes that a start killed midway left behind.

gs:// is shared by construction; the check costs a few small requests there and catches a
bucket path that differs between hosts all the same.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any

import tensorstore as ts

from tardigrade_trainer import distributed
from tardigrade_trainer.checkpoint.errors import CheckpointIOError
from tardigrade_trainer.checkpoint.layout import kvstore_spec
from tardigrade_trainer.config import ConfigError
from tardigrade_trainer.contract import DEFAULT_CHECKPOINT_BARRIER_TIMEOUT_SECONDS

PROBE_PREFIX = ".tardigrade-shared-probe-"
_PROBE_PREFIX_END = PROBE_PREFIX[:-1] + chr(ord(PROBE_PREFIX[-1]) + 1)
DEFAULT_VISIBILITY_SECONDS = 10.0
_POLL_SECONDS = 0.2
# Every process makes the same calls, so the n-th call's key-value names match across hosts
# and never collide with an earlier call's (the coordination service refuses to overwrite).
_calls = itertools.count()


class CheckpointPathNotSharedError(ConfigError):
    """The hosts of the gang do not see one another's files under the checkpoint root."""


def not_shared_message(root: str, seen: list[list[int]], hosts: list[str]) -> str:
    count = len(seen)
    views = "; ".join(f"host {p} ({hosts[p]}) sees {sorted(s)}" for p, s in enumerate(seen))
    return (
        f"spec.checkpoint.path {root} is not shared between hosts: each of the {count} hosts "
        f"wrote a probe file there and not every host sees all of them ({views}). Checkpoints "
        f"saved there could not be restored by the gang. An emptyDir or hostPath volume is "
        f"private to its pod or node: point spec.checkpoint.path at storage every host "
        f"shares, such as a ReadWriteMany PersistentVolumeClaim (e.g. Filestore), a gs:// "
        f"path, or a bucket mounted with gcsfuse (Cloud Storage FUSE CSI driver)."
    )


def _probe_key(token: str, process: int) -> str:
    return f"{PROBE_PREFIX}{token}-{process}"


def _probe_body(token: str, process: int) -> bytes:
    return json.dumps({"token": token, "process": process}).encode()


def _visible(kv: ts.KvStore, token: str, others: list[int], deadline: float) -> set[int]:
    """The processes among `others` whose probe this host can read before `deadline`."""
    found: set[int] = set()
    while True:
        for process in sorted(set(others) - found):
            result = kv.read(_probe_key(token, process)).result()
            if result.state == "value" and bytes(result.value) == _probe_body(token, process):
                found.add(process)
        if found == set(others) or time.monotonic() >= deadline:
            return found
        time.sleep(_POLL_SECONDS)


def check_shared(
    root: str,
    *,
    process_id: int,
    process_count: int,
    context_spec: Mapping[str, Any] | None = None,
    barrier_timeout_seconds: float = DEFAULT_CHECKPOINT_BARRIER_TIMEOUT_SECONDS,
    visibility_seconds: float = DEFAULT_VISIBILITY_SECONDS,
) -> None:
    """Return if every host sees every host's probe under `root`; else raise
    CheckpointPathNotSharedError on every host alike. A storage error on any host is a
    CheckpointIOError on every host, naming the host."""
    if process_count < 2:
        return
    call = next(_calls)
    token = distributed.all_gather_strings(
        f"tardigrade-shared-probe-{call}-token", uuid.uuid4().hex, barrier_timeout_seconds)[0]
    # A host whose storage fails still takes part in every step below, so that its peers learn
    # of the failure at the exchange instead of waiting out a barrier timeout.
    error = ""
    kv: ts.KvStore | None = None
    try:
        kv = ts.KvStore.open(kvstore_spec(root), context=ts.Context(dict(context_spec or {}))
                             ).result()
        kv.write(_probe_key(token, process_id), _probe_body(token, process_id)).result()
    except Exception as err:
        error = f"cannot write a probe under checkpoint path {root}: {err}"
    try:
        distributed.barrier(f"tardigrade-shared-probe-{token}-written", barrier_timeout_seconds)
        found: set[int] = set()
        if kv is not None and not error:
            others = [p for p in range(process_count) if p != process_id]
            try:
                found = _visible(kv, token, others, time.monotonic() + visibility_seconds)
            except Exception as err:
                error = f"cannot read probes under checkpoint path {root}: {err}"
        mine = json.dumps({"seen": sorted(found | {process_id}), "host": socket.gethostname(),
                           "error": error})
        views = [json.loads(v) for v in distributed.all_gather_strings(
            f"tardigrade-shared-probe-{token}-seen", mine, barrier_timeout_seconds)]
        if process_id == 0 and kv is not None:
            # Every host has read what it needs; probes of a start that was killed midway
            # would stay forever otherwise. One gang per root (nobody else probes here now).
            with contextlib.suppress(Exception):
                kv.delete_range(ts.KvStore.KeyRange(PROBE_PREFIX, _PROBE_PREFIX_END)).result()
    finally:
        if kv is not None:
            with contextlib.suppress(Exception):
                key = _probe_key(token, process_id)
                kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
    failures = [f"host {p} ({v['host']}): {v['error']}" for p, v in enumerate(views)
                if v["error"]]
    if failures:
        raise CheckpointIOError("; ".join(failures))
    everyone = list(range(process_count))
    seen = [view["seen"] for view in views]
    if any(sorted(s) != everyone for s in seen):
        raise CheckpointPathNotSharedError(
            not_shared_message(root, seen, [view["host"] for view in views]))
