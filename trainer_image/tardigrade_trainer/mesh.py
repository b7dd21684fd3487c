"""The device mesh: a slice axis across TPU slices (DCN), a data axis across the hosts of a slice,
and an optional model axis inside each host.

The batch is split over slice and data together and the parameters are replicated over both, so
the slice axis changes where the gradient reductions run (inside a slice over ICI, then across
slices over DCN), not the arithmetic. Multislice JAX numbers processes and devices slice by
slice; TPU devices carry `slice_index`. CPU devices carry none, so the emulation assigns them
to slices in process order, slice-major, which is the order the operator gives ranks
(MEGASCALE_SLICE_ID = rank // hosts per slice).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax.sharding import Mesh

from tardigrade_trainer.config import ConfigError, TrainerConfig

SLICE = "slice"
DATA = "data"
MODEL = "model"
NUM_SLICES_ENV = "MEGASCALE_NUM_SLICES"


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    mesh: Mesh
    # Logical (haliax) axis name -> physical mesh axis (or axes).
    axis_mapping: dict[str, str | tuple[str, ...]]

    @property
    def data_size(self) -> int:
        """Ways the batch is split: slices x hosts' data-parallel devices."""
        return int(self.mesh.shape[SLICE]) * int(self.mesh.shape[DATA])

    @property
    def batch_axes(self) -> tuple[str, str]:
        return (SLICE, DATA)

    @property
    def model_size(self) -> int:
        return int(self.mesh.shape[MODEL])

    def describe(self) -> dict[str, int]:
        slices = int(self.mesh.shape[SLICE])
        shape = {DATA: int(self.mesh.shape[DATA]), MODEL: self.model_size}
        return {SLICE: slices, **shape} if slices > 1 else shape


def slice_order(devices: list[jax.Device], num_slices: int) -> list[jax.Device]:
    """Devices slice-major: by `slice_index` where devices have one (TPU), else in process
    order cut into `num_slices` equal runs (CPU emulation)."""
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    if len(ordered) % num_slices:
        raise ConfigError(f"{len(ordered)} devices do not split into {num_slices} slices")
    per_slice = len(ordered) // num_slices
    indices = [getattr(d, "slice_index", None) for d in ordered]
    if all(i is not None for i in indices) and len(set(indices)) == num_slices:
        return sorted(ordered, key=lambda d: (d.slice_index, d.process_index, d.id))
    return [d for k in range(num_slices) for d in ordered[k * per_slice:(k + 1) * per_slice]]


def device_order(config: TrainerConfig, devices: list[jax.Device],
                 num_slices: int | None = None) -> list[jax.Device]:
    """The devices in the order of `build_mesh`'s grid, flattened (without the model's
    libraries: step_identity.py orders them before those are imported)."""
    return list(_grid(config, devices, num_slices).flat)


def build_mesh(config: TrainerConfig, devices: list[jax.Device] | None = None,
               num_slices: int | None = None) -> MeshPlan:
    from tardigrade_trainer import model  # haliax: see device_order

    grid = _grid(config, list(jax.devices() if devices is None else devices), num_slices)
    mapping: dict[str, str | tuple[str, ...]] = {
        model.BATCH: (SLICE, DATA), model.HEADS: MODEL, model.MLP: MODEL}
    return MeshPlan(mesh=Mesh(grid, (SLICE, DATA, MODEL)), axis_mapping=mapping)


def _grid(config: TrainerConfig, devices: list[jax.Device], num_slices: int | None
          ) -> np.ndarray:
    if num_slices is None:
        num_slices = int(os.environ.get(NUM_SLICES_ENV) or 1)
    data = config.check_devices(len(devices))
    if config.model_axis_size > 1 and jax.local_device_count() % config.model_axis_size:
        # Keeping a model-parallel group inside one host keeps its collectives off the network.
        raise ConfigError(
            f"model_axis_size={config.model_axis_size} must divide the "
            f"{jax.local_device_count()} devices of each process"
        )
    if data % num_slices:
        raise ConfigError(f"the data axis of {data} devices does not split into {num_slices} "
                          "slices")
    # Rows of the inner grid are host-local: devices are listed process by process.
    return np.array(slice_order(devices, num_slices)).reshape(
        num_slices, data // num_slices, config.model_axis_size
    )
