"""Each default is stated once: the API, the contract, the reference trainer's config and the
checkpoint library agree, whichever side a job leaves a setting unset on."""

from __future__ import annotations

import dataclasses
import inspect

from tardigrade_checkpoint import CheckpointManager, restoreplan
from tardigrade_checkpoint.storage import StorageRetries
from tardigrade_contract import contract
from tardigrade_operator.api.types import KeepPolicy as ApiKeepPolicy
from tardigrade_sdk.checkpoint_backend import keep_policy
from tardigrade_trainer.config import TrainerConfig

ENV = {contract.ENV_NUM_PROCESSES: "1", contract.ENV_PROCESS_ID: "0",
       contract.ENV_CHECKPOINT_PATH: "/ckpt"}


def test_keep_last_unset_keeps_what_the_api_default_keeps(tmp_path):
    last = ApiKeepPolicy().last
    assert last == contract.DEFAULT_CHECKPOINT_KEEP_LAST
    committed = list(range(10, 110, 10))
    newest = set(committed[-last:])
    # A pod whose environment has no keep-last (a job rendered before the setting existed,
    # or a trainer run by hand) keeps as many as a job that took the API's default.
    env = contract.TrainerEnvironment.from_env(ENV)
    assert env.checkpoint_keep_last is None
    assert keep_policy(env).keep(committed) == newest
    assert contract.TrainerEnvironment(
        "j", "ns", 0, "h:1", 1, 0, "/ckpt").keep_last == last
    manager = CheckpointManager(str(tmp_path))
    try:
        assert manager.keep.keep(committed) == newest
    finally:
        manager.close()


def test_the_trainer_config_exposes_the_checkpoint_library_defaults():
    config = TrainerConfig()
    manager = inspect.signature(CheckpointManager.__init__).parameters
    storage = StorageRetries()
    assert config.checkpoint_barrier_timeout_seconds == manager[
        "barrier_timeout_seconds"].default
    assert config.checkpoint_checksum == manager["checksum"].default
    assert config.checkpoint_verify_restore == manager["verify_restore"].default
    assert config.checkpoint_storage_retries == storage.max_retries
    assert config.checkpoint_storage_stall_seconds == storage.stall_seconds
    assert config.checkpoint_restore_inflight_mib << 20 == restoreplan.DEFAULT_INFLIGHT_BYTES
    assert (contract.TrainerEnvironment.from_env(ENV).init_timeout_seconds
            == {f.name: f.default for f in dataclasses.fields(contract.TrainerEnvironment)}[
                "init_timeout_seconds"])
