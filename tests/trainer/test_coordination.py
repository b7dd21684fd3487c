"""The coordination service's collectives and the shared-root check cost O(N) requests for a
gang of N hosts (tardigrade_checkpoint/coordination.py, checkpoint/sharedprobe.py), checked on a
gang of threads around an in-memory stand-in for JAX's coordination service."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from tardigrade_checkpoint import sharedprobe
from tardigrade_checkpoint.coordination import Coordination
from tardigrade_checkpoint.errors import CheckpointIOError
from tardigrade_checkpoint.sharedprobe import (
    CheckpointPathNotSharedError,
    check_shared,
    peers_to_read,
)


class Service:
    """JAX's coordination service as its clients see it: a key-value store that refuses to
    overwrite, blocking gets, directory reads and barriers; every request is counted."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.values: dict[str, str] = {}
        self.arrived: dict[str, int] = collections.Counter()
        self.requests: dict[str, int] = collections.Counter()
        self.changed = threading.Condition()

    def client(self) -> Client:
        return Client(self)


class Client:
    def __init__(self, service: Service) -> None:
        self.service = service

    def _wait(self, ready: Callable[[], bool], timeout_ms: int, what: str) -> None:
        with self.service.changed:
            if not self.service.changed.wait_for(ready, timeout_ms / 1000):
                raise TimeoutError(f"DEADLINE_EXCEEDED: {what}")

    def key_value_set(self, key: str, value: str) -> None:
        service = self.service
        with service.changed:
            service.requests["set"] += 1
            if key in service.values:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            service.values[key] = value
            service.changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        self.service.requests["get"] += 1
        self._wait(lambda: key in self.service.values, timeout_ms, key)
        return self.service.values[key]

    def key_value_dir_get(self, directory: str) -> list[tuple[str, str]]:
        self.service.requests["dir_get"] += 1
        with self.service.changed:
            return [(k, v) for k, v in self.service.values.items()
                    if k.startswith(directory + "/")]

    def wait_at_barrier(self, name: str, timeout_ms: int) -> None:
        service = self.service
        with service.changed:
            service.requests["barrier"] += 1
            service.arrived[name] += 1
            service.changed.notify_all()
        self._wait(lambda: service.arrived[name] >= service.count, timeout_ms, name)


def run_gang(count: int, task: Callable[[Coordination], Any]) -> tuple[list[Any], Service]:
    """`task` on every host of a gang of `count` threads; each host's result or exception."""
    service = Service(count)

    def host(pid: int) -> Any:
        try:
            return task(Coordination(service.client(), pid, count))
        except Exception as err:
            return err

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(host, range(count))), service


def test_a_gather_reaches_process_0_alone_in_process_order_with_o_n_requests():
    results, service = run_gang(
        64, lambda gang: gang.gather_to_root("g", f"v{gang.process_id}", 30))
    assert results[0] == [f"v{p}" for p in range(64)]
    assert results[1:] == [None] * 63
    # One set and one barrier a host, one directory read on process 0: no host reads every
    # host's key (64 x 64 gets).
    assert service.requests == {"set": 64, "barrier": 64, "dir_get": 1}


def test_process_0_s_value_reaches_every_host_with_one_request_each():
    results, service = run_gang(
        64, lambda gang: gang.from_root("r", "token" if gang.process_id == 0 else None, 30))
    assert results == ["token"] * 64
    assert service.requests == {"set": 1, "get": 63}


def test_a_host_that_never_comes_times_the_meeting_out():
    service = Service(3)
    gang = Coordination(service.client(), 1, 3)
    with pytest.raises(TimeoutError, match="DEADLINE_EXCEEDED"):
        gang.gather_to_root("g", "v", 0.2)


def test_each_host_reads_at_most_three_probes_and_every_host_is_read():
    for count in (2, 3, 4, 1024):
        read_by = collections.Counter()
        for pid in range(count):
            peers = peers_to_read(pid, count)
            assert pid not in peers and 1 <= len(peers) <= 3
            read_by.update(peers)
        assert set(read_by) == set(range(count))


@pytest.fixture(autouse=True)
def _new_gang() -> None:
    """Each test's hosts start counting their checks afresh, as new processes would."""
    sharedprobe._calls.clear()


def _check(roots: list[Path]) -> Callable[[Coordination], None]:
    def check(gang: Coordination) -> None:
        check_shared(str(roots[gang.process_id]), process_id=gang.process_id,
                     process_count=gang.process_count, barrier_timeout_seconds=20,
                     visibility_seconds=0.5, gang=gang)
    return check


@pytest.mark.parametrize("count", [3, 48])
def test_a_shared_root_passes_with_requests_linear_in_the_gang(tmp_path, count):
    results, service = run_gang(count, _check([tmp_path] * count))
    assert results == [None] * count
    assert list(tmp_path.iterdir()) == []  # every probe removed
    # The token and the verdict from process 0, the findings gathered to it, two barriers.
    assert service.requests["get"] == 2 * (count - 1)
    assert service.requests["set"] == count + 2
    assert service.requests["barrier"] == 2 * count and service.requests["dir_get"] == 1


def test_hosts_split_between_two_roots_all_fail_with_one_message_that_names_the_split(tmp_path):
    # 0-23 on one node's hostPath, 24-47 on another's: every host fails alike, and the hosts
    # on either side of each split are named.
    roots = [tmp_path / ("a" if p < 24 else "b") for p in range(48)]
    for root in set(roots):
        root.mkdir()
    results, _ = run_gang(48, _check(roots))
    assert all(isinstance(r, CheckpointPathNotSharedError) for r in results), results
    messages = {str(r).replace(str(roots[p]), "ROOT") for p, r in enumerate(results)}
    assert len(messages) == 1
    message = messages.pop()
    # Host 0 reads 47 and 1, host 23 reads 22, 24 and 0, host 24 reads 23, 25 and 0...
    for views in (") does not see host 47;", ") does not see host 24;",
                  ") does not see host 0, 23;", ") does not see host 0;"):
        assert views in message
    # 26 hosts missed a probe (0, 23 and every host of the second root, which reads 0's):
    # eight are named, so that the message fits the pod's termination message.
    assert message.count("does not see") == 8 and "; and 18 more hosts" in message
    assert len(message) < 4096  # fits the pod's termination message


def test_a_host_whose_storage_fails_fails_every_host_naming_it(tmp_path):
    (tmp_path / "a-file").write_text("x")
    roots = [tmp_path / "ok"] * 4 + [tmp_path / "a-file" / "ckpt"] + [tmp_path / "ok"] * 3
    results, _ = run_gang(8, _check(roots))
    assert all(isinstance(r, CheckpointIOError) for r in results), results
    assert all(str(r).startswith("host 4 (") for r in results)
