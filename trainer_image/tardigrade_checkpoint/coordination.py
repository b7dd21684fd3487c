"""Small collectives over JAX's coordination service: its key-value store and its barriers.

They need no device, so they are safe from a background thread while the loop runs, and each
costs O(N) requests for a gang of N processes: a gang of 1,024 hosts that gathered a value
from every host on every host (N blocking gets each) sent a million requests to the one
coordination service at every start. Every process makes the same calls with the same
names, and a name is used once: the service refuses to overwrite a key, and keys are not
deleted, since a slow peer may still be reading them.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Coordination:
    """This process's view of the gang's coordination service."""

    # jax's DistributedRuntimeClient, or anything with its key_value_set,
    # blocking_key_value_get, key_value_dir_get and wait_at_barrier.
    client: Any
    process_id: int
    process_count: int

    def barrier(self, name: str, timeout_seconds: float) -> None:
        """Wait until every process reaches `name`."""
        self.client.wait_at_barrier(name, _millis(timeout_seconds))

    def from_root(self, name: str, value: str | None, timeout_seconds: float) -> str:
        """Every process gets process 0's `value` (which only process 0 needs to pass)."""
        if self.process_id == 0:
            self.client.key_value_set(name, value or "")
            return value or ""
        return str(self.client.blocking_key_value_get(name, _millis(timeout_seconds)))

    def gather_to_root(self, name: str, value: str, timeout_seconds: float) -> list[str] | None:
        """Process 0 gets every process's `value` in process order, the others None; every
        process returns once all have set theirs (a meeting). One set, one barrier and, on
        process 0, one directory read."""
        self.client.key_value_set(f"{name}/{self.process_id}", value)
        self.barrier(f"{name}/set", timeout_seconds)
        if self.process_id != 0:
            return None
        entries = {str(key).rsplit("/", 1)[-1]: str(text)
                   for key, text in self.client.key_value_dir_get(name)}
        return [entries[str(process)] for process in range(self.process_count)]


def current() -> Coordination | None:
    """The gang's coordination service, or None outside a distributed run of 2+ processes."""
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    if state.client is None or state.num_processes in (None, 1):
        return None
    return Coordination(state.client, int(state.process_id), int(state.num_processes))


def _millis(seconds: float) -> int:
    return max(1, int(seconds * 1000))
