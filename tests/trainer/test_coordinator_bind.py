"""Where rank 0 listens: a one-process gang needs no coordinator at all, and a coordinator
that cannot bind is a config error that names the address, never a crash inside JAX."""

from __future__ import annotations

import socket

import pytest
from tardigrade_contract import contract
from tardigrade_contract.contract import TrainerEnvironment
from tardigrade_sdk import distributed
from tardigrade_trainer.config import ConfigError
from trainer_harness import committed_steps, launch

# TEST-NET-1 (RFC 5737): never an address of this host, so nothing can bind it.
NOT_THIS_HOST = "192.0.2.1"


def _env(processes: int, port: int) -> TrainerEnvironment:
    return TrainerEnvironment(job_name="j", namespace="n", attempt=0,
                              coordinator_address=f"127.0.0.1:{port}",
                              num_processes=processes, process_id=0, checkpoint_path="/x")


def _taken_port() -> socket.socket:
    """A port something else listens on (every address), held while the socket is open."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


@pytest.mark.slow
def test_a_one_process_gang_trains_and_saves_without_the_coordination_service(tmp_path):
    # The coordinator's port is taken and the pod's address is not this host's: a gang of one
    # that tried to start a coordinator anywhere would fail. It trains, saves and finishes.
    with _taken_port() as holder:
        port = holder.getsockname()[1]
        gang = launch(tmp_path, processes=1, checkpoint_path=str(tmp_path / "ckpt"),
                      config={"steps": 6}, interval_steps=3,
                      extra_env={contract.ENV_COORDINATOR_ADDRESS: f"127.0.0.1:{port}",
                                 contract.ENV_POD_IP: NOT_THIS_HOST})
        assert gang.wait() == [contract.EXIT_SUCCEEDED], gang.describe()
    startup = gang.events("startup")[0]
    assert startup["coordination_service"] is False
    assert "distributed_skipped" in startup and "distributed_initialized" not in startup
    assert committed_steps(tmp_path / "ckpt") == [3, 6]
    assert max(gang.losses()) == 6


@pytest.mark.slow
@pytest.mark.parametrize("cause", ["address not on this host", "port taken"])
def test_a_coordinator_that_cannot_bind_exits_as_a_config_error_naming_the_address(
        tmp_path, cause):
    with _taken_port() as holder:
        port = holder.getsockname()[1]
        rank_env = {contract.ENV_COORDINATOR_ADDRESS: f"127.0.0.1:{port}"}
        if cause == "address not on this host":
            rank_env[contract.ENV_POD_IP] = NOT_THIS_HOST
            named = f"{NOT_THIS_HOST}:{port}"
        else:
            named = f"0.0.0.0:{port}"
        # Rank 0 alone: it fails before it waits for anyone.
        gang = launch(tmp_path, processes=2, ranks=[0], checkpoint_path=str(tmp_path / "ckpt"),
                      config={"steps": 3}, rank_env={0: rank_env}, init_timeout=30)
        assert gang.wait(timeout=60) == [contract.EXIT_CONFIG_ERROR], gang.describe()
    note = gang.termination(0)
    assert note is not None and note.reason == "ConfigError"
    assert named in note.message and "cannot listen" in note.message
    stderr = gang.stderr(0).read_text()
    assert named in stderr and "Failed to add port" not in stderr


def test_one_process_starts_no_rendezvous_and_no_service(monkeypatch):
    import jax
    from jax._src import distributed as jax_distributed

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("jax.distributed.initialize called for a gang of one")

    def no_socket(*args: object, **kwargs: object) -> None:
        raise OSError(97, "Address family not supported by protocol")

    monkeypatch.setattr(jax.distributed, "initialize", refuse)
    monkeypatch.setattr(socket, "socket", no_socket)  # as on a host that allows none
    distributed.initialize(_env(1, 1))
    assert jax_distributed.global_state.client is None
    assert distributed.coordination.current() is None


def test_without_ipv6_rank_0_binds_ipv4_never_jax_s_default(monkeypatch):
    real = socket.socket

    def ipv4_only(family: int = socket.AF_INET, *args: object, **kwargs: object):
        if family == socket.AF_INET6:
            raise OSError(97, "Address family not supported by protocol")
        return real(family, *args, **kwargs)

    monkeypatch.delenv(contract.ENV_POD_IP, raising=False)
    monkeypatch.setattr(socket, "socket", ipv4_only)
    # Port 0 (any free port): a port found free a moment ago may be another test's by now.
    port = 0
    assert distributed.listen_address(port) == (socket.AF_INET, "0.0.0.0")
    _, bind = distributed.grpc_addresses(_env(2, port))
    assert bind == f"0.0.0.0:{port}"


def test_with_no_internet_socket_at_all_the_error_names_every_address_tried(monkeypatch):
    def none_allowed(*args: object, **kwargs: object) -> None:
        raise OSError(97, "Address family not supported by protocol")

    monkeypatch.delenv(contract.ENV_POD_IP, raising=False)
    monkeypatch.setattr(socket, "socket", none_allowed)
    with pytest.raises(distributed.CoordinatorBindError) as caught:
        distributed.grpc_addresses(_env(2, 8476))
    assert isinstance(caught.value, ConfigError)
    message = str(caught.value)
    assert "[::]:8476" in message and "0.0.0.0:8476" in message
    assert "Address family not supported" in message


def test_a_pod_ip_binds_that_address_alone(monkeypatch):
    monkeypatch.setenv(contract.ENV_POD_IP, "127.0.0.1")
    port = 0  # any free port (one found free a moment ago may be another test's by now)
    assert distributed.grpc_addresses(_env(2, port))[1] == f"127.0.0.1:{port}"
    monkeypatch.setenv(contract.ENV_POD_IP, NOT_THIS_HOST)
    with pytest.raises(distributed.CoordinatorBindError, match=f"{NOT_THIS_HOST}:{port}"):
        distributed.grpc_addresses(_env(2, port))
