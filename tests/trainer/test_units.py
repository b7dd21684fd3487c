"""Fast tests of the jax-free pieces: config, policies, rendezvous, progress server."""

from __future__ import annotations

import dataclasses
import json
import threading
import urllib.request

import pytest
from tardigrade_checkpoint.policy import (
    KeepEvery,
    KeepLast,
    SaveInterval,
    deletable,
    keep_union,
)
from tardigrade_contract import contract
from tardigrade_sdk import distributed
from tardigrade_trainer.config import ConfigError, TrainerConfig
from trainer_harness import free_port


def test_config_parses_and_rejects_bad_values():
    config = TrainerConfig.from_mapping({"steps": 5, "learning_rate": 1, "debug_state_hash": True})
    assert config.steps == 5 and config.learning_rate == 1.0 and config.debug_state_hash
    with pytest.raises(ConfigError, match="unknown trainer config keys: stepz"):
        TrainerConfig.from_mapping({"stepz": 5})
    with pytest.raises(ConfigError, match="must be an integer"):
        TrainerConfig.from_mapping({"steps": "5"})
    with pytest.raises(ConfigError, match="not divisible by num_heads"):
        TrainerConfig.from_mapping({"embed_dim": 10, "num_heads": 3})


def test_config_device_fit_is_explained():
    config = TrainerConfig(global_batch_size=12, model_axis_size=2, num_heads=2, mlp_dim=32)
    assert config.check_devices(4) == 2
    assert TrainerConfig(global_batch_size=12).check_devices(3) == 3
    with pytest.raises(ConfigError, match="cannot be split evenly over a data axis of 5"):
        TrainerConfig(global_batch_size=12).check_devices(5)
    with pytest.raises(ConfigError, match="does not divide the 3 devices"):
        config.check_devices(3)


def test_keep_policies_compose_and_never_release_the_newest():
    steps = [10, 20, 30, 40, 50]
    assert KeepLast(2).keep(steps) == {40, 50}
    assert KeepEvery(20).keep(steps) == {20, 40}
    policy = keep_union(KeepLast(2), KeepEvery(20))
    assert deletable(policy, steps) == [10, 30]
    assert deletable(KeepLast(0), steps) == [10, 20, 30, 40]
    assert deletable(KeepLast(1), []) == []


def test_save_interval_by_steps_and_time():
    now = [0.0]
    interval = SaveInterval(steps=5, seconds=10.0, clock=lambda: now[0])
    assert interval.due_by_step(10) and not interval.due_by_step(11)
    assert not interval.due_by_time()
    now[0] = 10.5
    assert interval.due_by_time()
    interval.saved()
    assert not interval.due_by_time()
    assert not SaveInterval().due_by_step(5) and not SaveInterval().due_by_time()


def test_contract_round_trip_and_new_exit_code():
    env = contract.TrainerEnvironment(
        job_name="j", namespace="n", attempt=2, coordinator_address="h:1", num_processes=3,
        process_id=1, checkpoint_path="gs://b/p", trainer_config={"steps": 3},
    )
    assert contract.TrainerEnvironment.from_env(env.to_env()) == env
    assert contract.EXIT_CHECKPOINT_CORRUPT not in contract.RETRYABLE_EXIT_CODES
    beating = dataclasses.replace(env, heartbeat_timeout_seconds=170)
    assert beating.to_env()[contract.ENV_HEARTBEAT_TIMEOUT_SECONDS] == "170"
    assert contract.TrainerEnvironment.from_env(beating.to_env()) == beating
    with pytest.raises(contract.ContractError, match=contract.ENV_HEARTBEAT_TIMEOUT_SECONDS):
        contract.TrainerEnvironment.from_env(
            {**env.to_env(), contract.ENV_HEARTBEAT_TIMEOUT_SECONDS: "0"})


def _env(rank: int, n: int, port: int, attempt: int = 0) -> contract.TrainerEnvironment:
    return contract.TrainerEnvironment(
        job_name="job", namespace="ns", attempt=attempt,
        coordinator_address=f"127.0.0.1:{port}", num_processes=n, process_id=rank,
        checkpoint_path="/unused", rendezvous_insecure=True,
    )


def _rendezvous_all(
    envs: list[contract.TrainerEnvironment], timeout: float | list[float]
) -> list[object]:
    timeouts = timeout if isinstance(timeout, list) else [timeout] * len(envs)
    results: list[object] = [None] * len(envs)

    def run(i: int) -> None:
        try:
            distributed.rendezvous(envs[i], timeouts[i])
            results[i] = "ok"
        except distributed.PeerTimeoutError as err:
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(envs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(timeouts) + 10)
    return results


def test_rendezvous_completes_when_everyone_arrives():
    port = free_port()
    assert _rendezvous_all([_env(r, 3, port) for r in range(3)], 20) == ["ok"] * 3


def test_rendezvous_names_the_missing_peer_instead_of_hanging():
    port = free_port()
    # Rank 1 waits longer than the coordinator, so it is still present when rank 0 gives up
    # (with equal deadlines it may leave first and be named missing too, which is also true).
    results = _rendezvous_all([_env(0, 3, port), _env(1, 3, port)], [1.5, 4.0])
    assert isinstance(results[0], distributed.PeerTimeoutError)
    assert "ranks [2] of 3" in str(results[0])
    assert isinstance(results[1], distributed.PeerTimeoutError)


def test_rendezvous_turns_away_a_stale_attempt():
    port = free_port()
    results = _rendezvous_all([_env(0, 2, port, attempt=1), _env(1, 2, port, attempt=0)], 2)
    assert isinstance(results[1], distributed.PeerTimeoutError)
    assert "rejected" in str(results[1]) and "attempt" in str(results[1])
    assert isinstance(results[0], distributed.PeerTimeoutError)


def test_progress_server_serves_report_and_metrics():
    from tardigrade_sdk.metrics import Metrics, ProgressServer

    metrics = Metrics()
    metrics.step.set(7)
    metrics.tokens.inc(2048)
    metrics.tokens.inc(2048)
    metrics.report(step=7, loss=1.5, checkpoint_step=5)
    server = ProgressServer(metrics, 0, host="127.0.0.1").start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(f"{base}/progress", timeout=5) as response:
            report = contract.ProgressReport.from_json(response.read().decode())
        assert report == contract.ProgressReport(step=7, loss=1.5, checkpoint_step=5)
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
            scraped = response.read().decode()
        assert "tardigrade_train_step 7.0" in scraped
        assert "# TYPE tardigrade_train_tokens_total counter" in scraped
        assert "tardigrade_train_tokens_total 4096.0" in scraped
    finally:
        server.stop()
    assert json.loads(report.to_json())["step"] == 7


def test_docs_list_every_contract_variable_and_exit_code():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()
    names = [v for k, v in vars(contract).items() if k.startswith("ENV_")]
    codes = [k for k in vars(contract) if k.startswith("EXIT_")]
    assert [n for n in names if f"`{n}`" not in text] == []
    assert [c for c in codes if f"`{c}`" not in text] == []


def test_compilation_cache_dir_is_a_string_option():
    from tardigrade_trainer.config import ConfigError, TrainerConfig

    assert TrainerConfig.from_mapping({}).compilation_cache_dir is None
    config = TrainerConfig.from_mapping({"compilation_cache_dir": "/cache/jax"})
    assert config.compilation_cache_dir == "/cache/jax"
    with pytest.raises(ConfigError, match=r"compilation_cache_dir.*non-empty string"):
        TrainerConfig.from_mapping({"compilation_cache_dir": 3})
