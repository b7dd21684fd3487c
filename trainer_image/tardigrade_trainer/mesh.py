"""The device mesh: a data axis across all hosts and an optional model axis inside each host."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from tardigrade_trainer import model
from tardigrade_trainer.config import ConfigError, TrainerConfig

DATA = "data"
MODEL = "model"


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    mesh: Mesh
    # Logical (haliax) axis name -> physical mesh axis.
    axis_mapping: dict[str, str]

    @property
    def data_size(self) -> int:
        return int(self.mesh.shape[DATA])

    @property
    def model_size(self) -> int:
        return int(self.mesh.shape[MODEL])

    def describe(self) -> dict[str, int]:
        return {DATA: self.data_size, MODEL: self.model_size}


def build_mesh(config: TrainerConfig, devices: list[jax.Device] | None = None) -> MeshPlan:
    devices = list(jax.devices() if devices is None else devices)
    data = config.check_devices(len(devices))
    if config.model_axis_size > 1 and jax.local_device_count() % config.model_axis_size:
        # Keeping a model-parallel group inside one host keeps its collectives off the network.
        raise ConfigError(
            f"model_axis_size={config.model_axis_size} must divide the "
            f"{jax.local_device_count()} devices of each process"
        )
    # jax.devices() lists devices grouped by process, so rows of this grid are host-local.
    grid = np.array(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(
        data, config.model_axis_size
    )
    mapping = {model.BATCH: DATA, model.HEADS: MODEL, model.MLP: MODEL}
    return MeshPlan(mesh=Mesh(grid, (DATA, MODEL)), axis_mapping=mapping)
