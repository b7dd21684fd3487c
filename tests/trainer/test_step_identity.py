"""The cached step's load started as the devices open (step_identity.py): the trainer takes it
over only for the entry and the devices it would load itself."""

from __future__ import annotations

import dataclasses

import jax
from tardigrade_trainer import mesh, step_cache, step_identity
from tardigrade_trainer.config import TrainerConfig
from tardigrade_trainer.train import Trainer


def test_the_early_load_is_taken_only_for_the_same_entry_and_devices(tmp_path):
    config = TrainerConfig()
    early = step_identity.EarlyPreload(tmp_path, config)
    devices = list(mesh.build_mesh(config).mesh.devices.flat)
    assert mesh.device_order(config, jax.devices()) == devices
    key = step_identity.preload_key(config, devices)
    taken = early.preload(key, devices)
    assert taken is not None and taken.key == key and taken.devices == devices
    # Its cache is the one the trainer reads: this rank's folder under the local copy.
    assert taken.cache.folder == step_cache.StepCache(tmp_path, 0).folder
    assert taken.result().found is False  # nothing stored yet: the trainer compiles
    assert early.preload("another entry", devices) is None
    if len(devices) > 1:
        assert early.preload(key, devices[::-1]) is None
    early.wait()


def test_the_key_changes_with_the_configuration_and_the_devices():
    config = TrainerConfig()
    devices = list(mesh.build_mesh(config).mesh.devices.flat)
    key = step_identity.preload_key(config, devices)
    assert step_identity.preload_key(config, devices) == key
    assert step_identity.preload_key(dataclasses.replace(config, embed_dim=config.embed_dim * 2),
                                     devices) != key
    assert step_identity.preload_key(config, devices[:1]) != key or len(devices) == 1
    assert Trainer.DONATE == step_identity.DONATE
