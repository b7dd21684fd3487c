"""Simulated containers and trainer gangs (simulator/simulated.py, simulator/simgang.py) on their
own: the promises of the real trainer, kept without processes."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import aiohttp
import pytest
from tardigrade_contract import contract
from tardigrade_local.simulator import network
from tardigrade_local.simulator.simulated import PID_BASE, SimulatedRuntime

STEP_SECONDS = 0.02


def rank_env(tmp_path: Path, rank: int, size: int, attempt: int = 0, steps: int = 10_000,
             restore: str = contract.RESTORE_LATEST, save: bool = True,
             init_timeout: float = 30.0) -> dict[str, str]:
    env = contract.TrainerEnvironment(
        job_name="job", namespace="ns", attempt=attempt, coordinator_address="x:1",
        num_processes=size, process_id=rank, checkpoint_path=str(tmp_path / "ckpt"),
        restore_step=restore, checkpoint_interval_steps=5, save_on_preemption=save,
        progress_port=contract.DEFAULT_PROGRESS_PORT,
        trainer_config={"steps": steps, "step_seconds": STEP_SECONDS},
        termination_log=str(tmp_path / f"a{attempt}-r{rank}.termination-log"),
        init_timeout_seconds=init_timeout,
    ).to_env()
    return {**env, contract.ENV_POD_IP: "127.0.0.1"}


def termination(tmp_path: Path, rank: int, attempt: int = 0) -> dict:
    return json.loads((tmp_path / f"a{attempt}-r{rank}.termination-log").read_text())


async def start_gang(runtime: SimulatedRuntime, tmp_path: Path, size: int, **options):
    containers = [runtime.container(rank_env(tmp_path, r, size, **options)) for r in range(size)]
    for container in containers:
        await container.start()
    return containers


async def wait_until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_a_gang_trains_only_once_every_rank_has_joined(tmp_path):
    runtime = SimulatedRuntime()
    first = runtime.container(rank_env(tmp_path, 0, 2))
    assert await first.start() >= PID_BASE  # never a real process id
    gang = first.rank.gang
    await asyncio.sleep(5 * STEP_SECONDS)
    assert gang.step() == 0 and gang.started_at is None
    second = runtime.container(rank_env(tmp_path, 1, 2))
    await second.start()
    await wait_until(lambda: gang.step() >= 3)
    await runtime.stop()


async def test_sigterm_to_one_rank_saves_one_step_for_all_and_the_next_gang_restores_it(
        tmp_path):
    runtime = SimulatedRuntime()
    ranks = await start_gang(runtime, tmp_path, 3)
    await wait_until(lambda: ranks[0].rank.gang.step() >= 7)
    ranks[1].signal_group(signal.SIGTERM)  # the kubelet's node shutdown of one host
    async with asyncio.timeout(10):
        codes = await asyncio.gather(*(r.wait() for r in ranks))
    assert codes == [contract.EXIT_PREEMPTED_SAVED] * 3
    messages = [termination(tmp_path, r) for r in range(3)]
    saved = messages[0]["checkpoint_step"]
    assert saved >= 8 and all(m["reason"] == "PreemptedSaved" for m in messages)
    assert {(m["step"], m["checkpoint_step"]) for m in messages} == {(saved, saved)}
    # The relaunched gang (next attempt) restores exactly that step.
    again = await start_gang(runtime, tmp_path, 3, attempt=1, restore=str(saved))
    assert again[0].rank.gang.restored == saved
    for container in again:
        container.signal_group(signal.SIGKILL)
    await runtime.stop()


async def test_a_killed_rank_stalls_its_peers_which_then_cannot_save(tmp_path):
    runtime = SimulatedRuntime()
    ranks = await start_gang(runtime, tmp_path, 2)
    gang = ranks[0].rank.gang
    await wait_until(lambda: gang.step() >= 2)
    ranks[1].signal_group(signal.SIGKILL)  # its host vanished
    assert await ranks[1].wait() == -signal.SIGKILL
    stalled = gang.step()
    await asyncio.sleep(5 * STEP_SECONDS)
    assert gang.step() == stalled
    # Its save never completes: the kubelet's grace runs out and SIGKILL ends it.
    await ranks[0].terminate(0.2)
    assert await ranks[0].wait() == -signal.SIGKILL
    await runtime.stop()


async def test_without_save_on_preemption_sigterm_kills_the_rank(tmp_path):
    runtime = SimulatedRuntime()
    ranks = await start_gang(runtime, tmp_path, 1, save=False)
    ranks[0].signal_group(signal.SIGTERM)
    assert await ranks[0].wait() == -signal.SIGTERM


async def test_a_peer_that_never_joins_times_the_gang_out(tmp_path):
    runtime = SimulatedRuntime()
    alone = runtime.container(rank_env(tmp_path, 0, 2, init_timeout=0.1))
    await alone.start()
    assert await alone.wait() == contract.EXIT_PEER_TIMEOUT
    assert termination(tmp_path, 0)["reason"] == "PeerTimeout"


async def test_a_pin_past_every_committed_step_is_a_corrupt_checkpoint(tmp_path):
    # The operator's pin is a floor: nothing committed at step 40 or newer.
    runtime = SimulatedRuntime()
    ranks = await start_gang(runtime, tmp_path, 2, restore="40")
    assert [await r.wait() for r in ranks] == [contract.EXIT_CHECKPOINT_CORRUPT] * 2
    assert "no checkpoint at step 40 or newer" in termination(tmp_path, 1)["message"]


async def test_the_gang_finishes_with_succeeded_and_commits_the_last_step(tmp_path):
    runtime = SimulatedRuntime()
    ranks = await start_gang(runtime, tmp_path, 2, steps=6)
    assert [await r.wait() for r in ranks] == [0, 0]
    assert termination(tmp_path, 0) == {"reason": "Succeeded", "step": 6, "checkpoint_step": 6,
                                        "checkpoint_path": str(tmp_path / "ckpt" / "step_6")}


async def test_a_relative_checkpoint_path_is_a_config_error_naming_it(tmp_path):
    runtime = SimulatedRuntime()
    env = {**rank_env(tmp_path, 0, 1), contract.ENV_CHECKPOINT_PATH: "gs://bucket/x"}
    container = runtime.container(env)
    await container.start()
    assert await container.wait() == contract.EXIT_CONFIG_ERROR
    assert "gs://bucket/x" in termination(tmp_path, 0)["message"]


async def test_a_container_that_is_no_rank_idles_until_signalled(tmp_path):
    runtime = SimulatedRuntime()
    container = runtime.container({"PATH": "/bin"})
    await container.start()
    await asyncio.sleep(0.05)
    assert not container.exited
    await container.terminate(5)
    assert await container.wait() == -signal.SIGTERM


@pytest.mark.skipif(not network.loopback_aliases_work(), reason="needs 127/8 on loopback")
async def test_rank_0_serves_progress_on_its_pod_ip_until_it_exits(tmp_path):
    runtime = SimulatedRuntime()
    ip = network.IpAllocator().allocate()
    envs = [{**rank_env(tmp_path, r, 2), contract.ENV_POD_IP: ip} for r in range(2)]
    ranks = [runtime.container(e) for e in envs]
    for container in ranks:
        await container.start()
    url = f"http://{ip}:{contract.DEFAULT_PROGRESS_PORT}/progress"
    async with aiohttp.ClientSession() as session:
        async def report() -> contract.ProgressReport | None:
            try:
                async with session.get(url) as response:
                    if response.status != 200:  # as the operator reads it (progress.py)
                        return None
                    return contract.ProgressReport.from_json(await response.text())
            except aiohttp.ClientError:
                return None

        async with asyncio.timeout(10):
            while (progress := await report()) is None or progress.step < 6:
                await asyncio.sleep(0.02)
        saved = progress.step - progress.step % 5  # a commit every 5 steps
        assert progress.total_steps == 10_000 and progress.checkpoint_step == saved
        assert progress.checkpoint_path == str(tmp_path / "ckpt" / f"step_{saved}")
        for container in ranks:
            container.signal_group(signal.SIGKILL)
        async with asyncio.timeout(10):
            while await report() is not None:
                await asyncio.sleep(0.02)
    await runtime.stop()


async def test_a_simulated_rank_restarts_into_the_world_its_request_carried(tmp_path):
    """As the real trainer: the world comes in the operator's request, not only the pod's
    annotation, so a container restarted before the patch arrives runs the new attempt."""
    runtime = SimulatedRuntime()
    ip = network.IpAllocator().allocate()
    keep = tmp_path / "emptydir"
    keep.mkdir()
    env = {**rank_env(tmp_path, 0, 1, attempt=1), contract.ENV_POD_IP: ip,
           contract.ENV_RESTART_KEY: "k" * 32, contract.ENV_RESTART_IN_PLACE_DIR: str(keep)}
    first = runtime.container(env)
    await first.start()
    world = {"attempt": 2, "numProcesses": 1, "processId": 0,
             "coordinatorAddress": "x:1", "restoreStep": "latest"}
    url = (f"http://{ip}:{contract.DEFAULT_PROGRESS_PORT}{contract.RESTART_IN_PLACE_PATH}"
           "?attempt=2")
    async def ask(session: aiohttp.ClientSession) -> int | None:
        try:
            async with session.post(url, headers={"Authorization": "Bearer " + "k" * 32},
                                    data=json.dumps(world)) as answer:
                return answer.status
        except aiohttp.ClientConnectionError:
            return None  # the rank serves once its gang has started

    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        while (status := await ask(session)) is None:
            await asyncio.sleep(0.02)
    assert status == 202
    async with asyncio.timeout(10):
        assert await first.wait() == contract.EXIT_RESTART_IN_PLACE
    # Restarted by its kubelet with the same environment (the patch has not arrived).
    again = runtime.container(env)
    await again.start()
    assert not again.exited and again.rank is not None and again.rank.env.attempt == 2
    again.signal_group(signal.SIGKILL)
    await runtime.stop()


async def test_a_simulated_rank_told_by_a_peer_outwaits_the_one_whose_pod_goes(tmp_path,
                                                                               monkeypatch):
    """As the real trainer (inplace.release_deadline): after the save the rank that got the
    SIGTERM leaves when a going pod's wait ends; its peer, whose pod is not being stopped,
    waits longer for the operator's word, until its own SIGTERM shortens the wait."""
    from tardigrade_sdk import inplace

    monkeypatch.setattr(inplace, "RELEASE_WAIT_SECONDS", 0.2)
    monkeypatch.setattr(inplace, "RELEASE_WAIT_PER_RANK_SECONDS", 0.0)
    monkeypatch.setattr(inplace, "PEER_NOTICE_RELEASE_WAIT_SECONDS", 30.0)
    runtime = SimulatedRuntime()
    allocator = network.IpAllocator()
    ranks = []
    for rank in range(2):
        keep = tmp_path / f"emptydir-{rank}"
        keep.mkdir()
        env = {**rank_env(tmp_path, rank, 2), contract.ENV_POD_IP: allocator.allocate(),
               contract.ENV_RESTART_IN_PLACE_DIR: str(keep)}
        ranks.append(runtime.container(env))
    for container in ranks:
        await container.start()
    await wait_until(lambda: ranks[0].rank.gang.step() >= 3)
    ranks[1].signal_group(signal.SIGTERM)  # its node shuts down
    async with asyncio.timeout(10):
        assert await ranks[1].wait() == contract.EXIT_RESTART_IN_PLACE
    await asyncio.sleep(0.5)  # past a going pod's wait
    assert not ranks[0].exited
    ranks[0].signal_group(signal.SIGTERM)  # now its own pod is stopped too
    async with asyncio.timeout(5):
        assert await ranks[0].wait() == contract.EXIT_RESTART_IN_PLACE
    await runtime.stop()


async def test_a_rank_that_has_left_gives_no_http_answer_before_its_socket_closes():
    """A real trainer's sockets go with its process: a request in the moment between a
    simulated rank's exit and its listening socket's closing is dropped, never answered 404
    (which the operator reads as "restart in place is off in that pod")."""
    from types import SimpleNamespace

    from tardigrade_local.simulator.simulated import ProgressEndpoints

    endpoints = ProgressEndpoints()
    ip = network.IpAllocator().allocate()
    rank = SimpleNamespace(env=SimpleNamespace(progress_port=contract.DEFAULT_PROGRESS_PORT),
                           gang=SimpleNamespace(key=("ns", "job", 1, 1)), process_id=0,
                           exit=None, frozen=False)
    await endpoints.open(rank, ip)
    rank.exit = object()  # it has left; its socket is not closed yet
    base = f"http://{ip}:{contract.DEFAULT_PROGRESS_PORT}"
    async with aiohttp.ClientSession() as session:
        for method, path in (("GET", "/progress"), ("POST", contract.RESTART_IN_PLACE_PATH)):
            with pytest.raises(aiohttp.ServerDisconnectedError):
                async with session.request(method, base + path):
                    pass
    await endpoints.stop()
