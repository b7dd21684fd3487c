"""Start-up check that every host of the gang sees the same checkpoint root.

A local path that is private to a pod or a node (an emptyDir or hostPath volume, a node's own
disk) takes every host's shards and process 0's commit marker without complaint, and then no
gang can restore it: each host finds only what it wrote itself. So before the first save or
restore every host writes a small probe file under the root and reads its neighbours';
otherwise the job stops with a configuration error that says how to fix it.

1. The hosts agree on a token for this start (process 0's, through the coordination service).
2. Each host writes `.tardigrade-shared-probe-<token>-<process>` under the root.
3. After a barrier, each host reads the probes of its two neighbours on the ring of process
   ids and process 0's (`peers_to_read`), retrying a missing one for a bounded time: NFS
   clients cache lookups, failed ones included, for a few seconds. Any split of the gang into
   hosts that see different roots puts two neighbours on either side of it, and one of them
   finds the other's probe missing; reading every host's probe instead costs N reads a host,
   a million storage reads at every start of a 1,024-host gang.
4. Process 0 gathers what each host found and tells every host the verdict, so they all
   report the same error.
5. Each host deletes its own probe, the one file it surely can reach; process 0 also
   removes probes that a start killed midway left behind.

gs:// is shared by construction; the check costs a few small requests there and catches a
bucket path that differs between hosts all the same.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any

import tensorstore as ts
from tardigrade_contract.contract import DEFAULT_CHECKPOINT_BARRIER_TIMEOUT_SECONDS, ConfigError

from tardigrade_checkpoint import coordination
from tardigrade_checkpoint.coordination import Coordination
from tardigrade_checkpoint.errors import CheckpointIOError
from tardigrade_checkpoint.layout import kvstore_spec

PROBE_PREFIX = ".tardigrade-shared-probe-"
_PROBE_PREFIX_END = PROBE_PREFIX[:-1] + chr(ord(PROBE_PREFIX[-1]) + 1)
DEFAULT_VISIBILITY_SECONDS = 10.0
_POLL_SECONDS = 0.2
# The error goes into the pod's termination message (4 KiB, the kubelet truncates the rest).
MAX_HOSTS_NAMED = 8
# Every process makes the same calls, so the n-th call's key-value names match across hosts
# and never collide with an earlier call's (the coordination service refuses to overwrite).
# Counted per process id: a test may run a gang's hosts as threads of one process.
_calls: dict[int, itertools.count[int]] = collections.defaultdict(itertools.count)


class CheckpointPathNotSharedError(ConfigError):
    """The hosts of the gang do not see one another's files under the checkpoint root."""


def not_shared_message(root: str, missing: Mapping[int, list[int]], hosts: Mapping[int, str],
                       count: int, more: int = 0) -> str:
    """`missing`: host -> the hosts whose probes it could not read; `more`: how many other
    hosts missed one (not named: the message must fit a termination message)."""
    views = "; ".join(f"host {p} ({hosts[p]}) does not see host {', '.join(map(str, seen))}"
                      for p, seen in sorted(missing.items()))
    if more:
        views += f"; and {more} more hosts"
    return (
        f"spec.checkpoint.path {root} is not shared between hosts: each of the {count} hosts "
        f"wrote a probe file there and read its neighbours', and not every probe was there "
        f"({views}). Checkpoints "
        f"saved there could not be restored by the gang. An emptyDir or hostPath volume is "
        f"private to its pod or node: point spec.checkpoint.path at storage every host "
        f"shares, such as a ReadWriteMany PersistentVolumeClaim (e.g. Filestore), a gs:// "
        f"path, or a bucket mounted with gcsfuse (Cloud Storage FUSE CSI driver)."
    )


def peers_to_read(process_id: int, process_count: int) -> list[int]:
    """The hosts whose probes this host reads: its two neighbours on the ring and process 0."""
    return sorted({(process_id - 1) % process_count, (process_id + 1) % process_count, 0}
                  - {process_id})


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
    gang: Coordination | None = None,
) -> None:
    """Return if every host sees its neighbours' probes under `root`; else raise
    CheckpointPathNotSharedError on every host alike. A storage error on any host is a
    CheckpointIOError on every host, naming the host. `gang`: the coordination service
    (that of the distributed run by default)."""
    if process_count < 2:
        return
    gang = gang or coordination.current()
    if gang is None:
        raise RuntimeError("check_shared needs the gang's coordination service")
    call = next(_calls[process_id])
    token = gang.from_root(f"tardigrade-shared-probe-{call}-token", uuid.uuid4().hex,
                           barrier_timeout_seconds)
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
        gang.barrier(f"tardigrade-shared-probe-{token}-written", barrier_timeout_seconds)
        others = peers_to_read(process_id, process_count)
        found: set[int] = set()
        if kv is not None and not error:
            try:
                found = _visible(kv, token, others, time.monotonic() + visibility_seconds)
            except Exception as err:
                error = f"cannot read probes under checkpoint path {root}: {err}"
        mine = json.dumps({"missing": [] if error else sorted(set(others) - found),
                           "host": socket.gethostname(), "error": error})
        views = gang.gather_to_root(f"tardigrade-shared-probe-{token}-seen", mine,
                                    barrier_timeout_seconds)
        verdict = gang.from_root(f"tardigrade-shared-probe-{token}-verdict",
                                 None if views is None else _verdict(views),
                                 barrier_timeout_seconds)
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
    told = json.loads(verdict)
    if told["failures"]:
        raise CheckpointIOError("; ".join(told["failures"]))
    if told["missing"]:
        missing = {int(p): list(seen) for p, seen in told["missing"].items()}
        hosts = {int(p): str(name) for p, name in told["hosts"].items()}
        raise CheckpointPathNotSharedError(
            not_shared_message(root, missing, hosts, process_count, told["more"]))


def _verdict(views: list[str]) -> str:
    """Process 0's summary of every host's findings, small whatever the gang's size: the
    storage failures and the hosts that missed a probe (at most MAX_HOSTS_NAMED named)."""
    failures: list[str] = []
    missing: dict[int, list[int]] = {}
    hosts: dict[int, str] = {}
    more = 0
    for process, view in enumerate(json.loads(v) for v in views):
        if view["error"] and len(failures) < MAX_HOSTS_NAMED:
            failures.append(f"host {process} ({view['host']}): {view['error']}")
        elif view["missing"] and len(missing) < MAX_HOSTS_NAMED:
            missing[process], hosts[process] = view["missing"], view["host"]
        elif view["missing"]:
            more += 1
    return json.dumps({"failures": failures, "missing": missing, "hosts": hosts, "more": more})
