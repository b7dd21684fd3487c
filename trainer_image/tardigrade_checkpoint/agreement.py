"""How the hosts of a gang agree on one save's outcome, failures included, within seconds.

A save has three meeting points: process 0 has prepared the step directory, every host has
written its shards (and sends their digests), process 0 has written the commit marker. With
plain barriers a host that fails never arrives, and every other host waits for the barrier
timeout (10 minutes by default) before it learns anything, then reports a timeout instead
of the cause. Here each meeting point is a message in the coordination service's key-value
store (the one `jax.distributed` starts, reachable from a background thread), and a message
says either "done" or "failed, and why":

    <save>/prepared        process 0: {"ok": true} or {"failure": ...}
    <save>/written/<pid>   every host: {"digests": ...} or {"failure": ...}
    <save>/outcome         process 0: {"ok": true} or {"failure": ...}

Process 0 reads every host's `written` message as it arrives and publishes the outcome the
moment one host has failed or the commit marker is written (or could not be); the others
wait on `prepared` and `outcome` only. So a failure anywhere reaches every host as soon as
the failing host has said so, and every host reports the same cause, with its kind
("io": storage, retryable; "deadline": a save on notice ran out of time, retryable;
"failed": anything else, not retryable). A host that dies without saying anything is still
found out by the timeout only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from typing import Any

from tardigrade_checkpoint.deadline import Deadline, DeadlineExceeded, bounded

IO = "io"
DEADLINE = "deadline"
FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why a host could not do its part of a save."""

    process: int
    kind: str  # IO, DEADLINE or FAILED
    message: str

    def describe(self) -> str:
        return f"process {self.process}: {self.message}"


class PeerFailed(Exception):
    """Another host reported a failure of this save."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.describe())
        self.failure = failure


class PeerSilent(Exception):
    """A host said nothing within the timeout (dead, stuck, or not started)."""


def _client() -> Any:
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    if state.client is None or state.num_processes in (None, 1):
        return None
    return state.client


class Channel:
    """One save's messages; every host of the gang builds one with the same `name`."""

    def __init__(self, name: str, process_id: int, process_count: int,
                 timeout_seconds: float, deadline: Deadline | None = None) -> None:
        self.name = name
        self.process_id = process_id
        self.process_count = process_count
        self.timeout_seconds = timeout_seconds
        self.deadline = deadline
        self._client = _client() if process_count > 1 else None

    # --- sending --------------------------------------------------------------------------
    def _set(self, key: str, payload: dict[str, Any]) -> None:
        if self._client is not None:
            self._client.key_value_set(f"{self.name}/{key}", json.dumps(payload),
                                       allow_overwrite=True)

    def prepared(self, failure: Failure | None = None) -> None:
        self._set("prepared", {"ok": True} if failure is None else _encode(failure))

    def written(self, digests: Any = None, failure: Failure | None = None) -> None:
        payload = {"digests": digests} if failure is None else _encode(failure)
        self._set(f"written/{self.process_id}", payload)

    def outcome(self, failure: Failure | None = None) -> None:
        self._set("outcome", {"ok": True} if failure is None else _encode(failure))

    def fail(self, failure: Failure) -> None:
        """Tell every host that this save failed here, wherever each of them waits."""
        if self.process_id == 0:
            self.prepared(failure)
            self.outcome(failure)
        else:
            self.written(failure=failure)

    # --- receiving ------------------------------------------------------------------------
    def _get(self, key: str, sender: str) -> dict[str, Any]:
        timeout = bounded(self.deadline, self.timeout_seconds)
        try:
            raw = self._client.blocking_key_value_get(f"{self.name}/{key}",
                                                      max(1, math.ceil(timeout * 1000)))
        except Exception as err:
            if self.deadline is not None and self.deadline.passed():
                raise DeadlineExceeded(
                    f"{sender} had not reported at {self.deadline.what}") from None
            raise PeerSilent(f"{sender} did not report within {timeout:.0f}s: {err}") from err
        payload = json.loads(raw)
        if "failure" in payload:
            raise PeerFailed(Failure(**payload["failure"]))
        return dict(payload)

    def wait_prepared(self) -> None:
        if self._client is not None and self.process_id != 0:
            self._get("prepared", "process 0 (preparing the step)")

    def gather_written(self, own: Any) -> list[Any]:
        """Process 0: every host's digests in process order; raises on the first failure."""
        if self._client is None:
            return [own]
        gathered = [own]
        try:
            for process in range(1, self.process_count):
                gathered.append(self._get(f"written/{process}",
                                          f"process {process} (writing its shards)")["digests"])
        finally:
            for process in range(1, self.process_count):
                self._delete(f"{self.name}/written/{process}")
        return gathered

    def wait_outcome(self) -> None:
        if self._client is not None and self.process_id != 0:
            self._get("outcome", "process 0 (committing)")

    def forget(self, name: str) -> None:
        """Process 0: drop an earlier save's messages (every host has read them by now)."""
        if self._client is not None and self.process_id == 0:
            self._delete(name)  # a directory: every key under it goes too

    def _delete(self, key: str) -> None:
        with contextlib.suppress(Exception):  # tidying up; a leftover costs a few bytes
            self._client.key_value_delete(key)


def _encode(failure: Failure) -> dict[str, Any]:
    return {"failure": dataclasses.asdict(failure)}
