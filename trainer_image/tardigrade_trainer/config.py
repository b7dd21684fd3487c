"""The reference trainer's configuration: `spec.trainer` of a TrainingJob, parsed without jax."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tardigrade_contract import contract
from tardigrade_contract.contract import ConfigError

# Keys whose default is None, so their type cannot be read off the default.
_STRING_KEYS = frozenset({"compilation_cache_dir"})
# Integer keys whose unset value (None) means "automatic", also written "auto".
_AUTO_INT_KEYS = frozenset({"checkpoint_snapshot_device_mib"})
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    steps: int = 100
    seed: int = 0
    global_batch_size: int = 8
    seq_len: int = 16
    vocab_size: int = 64
    embed_dim: int = 32
    num_layers: int = 1
    num_heads: int = 2
    mlp_dim: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 10
    weight_decay: float = 0.01
    # CPU only: how many host-platform devices each process pretends to have.
    devices_per_process: int | None = None
    model_axis_size: int = 1
    # Recompute attention in the backward pass instead of keeping its probabilities (model.py):
    # much less device memory at long sequences, a few percent more FLOPs.
    recompute_attention: bool = True
    log_every: int = 1
    # Gathers the whole state after every save/restore to log a hash: for tests, costly at scale.
    debug_state_hash: bool = False
    # How long a host waits for its peers at a checkpoint barrier before the save is failed.
    checkpoint_barrier_timeout_seconds: float = (
        contract.DEFAULT_CHECKPOINT_BARRIER_TIMEOUT_SECONDS)
    # A zarr crc32c per chunk, on top of the digests in the commit marker (which already
    # check every restored byte): for tools that read the arrays without the marker. Costly:
    # TensorStore's PyPI build computes crc32c at ~2.3 GB/s per core, on save and on restore.
    checkpoint_checksum: bool = False
    # Object storage (gs://): retries of a failed or stalled request (429, 5xx, transport
    # errors), and how long a request may receive nothing before it counts as failed.
    checkpoint_storage_retries: int = contract.DEFAULT_STORAGE_RETRIES
    checkpoint_storage_stall_seconds: int = contract.DEFAULT_STORAGE_STALL_SECONDS
    # Compare the restored shards with the digests recorded at save time (one hash pass).
    checkpoint_verify_restore: bool = True
    # Host memory a restore may fill with reads not yet checked and put on their devices.
    checkpoint_restore_inflight_mib: int = contract.DEFAULT_RESTORE_INFLIGHT_MIB
    # On an accelerator, device memory (MiB per device) a save may fill with a copy of the
    # state, so that `save` returns before the device->host copy, which then overlaps the
    # steps. Unset, null or "auto" (the default): as much as the compiled step leaves free,
    # less a margin (checkpoint/stagingbudget.py); a number caps that; 0 turns staging off.
    # 0 meant "never" before there was an automatic budget, and still does.
    checkpoint_snapshot_device_mib: int | None = None
    # JAX's persistent compilation cache: a relaunched gang that finds its compiled programs
    # here starts training seconds sooner. A path (a volume the relaunched pods share) or a
    # gs:// URL. Unset: `<checkpoint root>/compilation-cache` (compile_cache.py), unless
    # compilation_cache_in_root is false (no cache).
    compilation_cache_dir: str | None = None
    compilation_cache_in_root: bool = True

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> TrainerConfig:
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(f"unknown trainer config keys: {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for name, value in raw.items():
            default = getattr(cls, name)
            if name in _AUTO_INT_KEYS and value == AUTO:
                value = None
            if value is None:
                values[name] = None
                continue
            want: type = int
            if name in _STRING_KEYS:
                want = str
            elif isinstance(default, bool):
                want = bool
            elif isinstance(default, float):
                want = float
            if want is bool and not isinstance(value, bool):
                raise ConfigError(f"trainer config {name!r} must be true or false, got {value!r}")
            if want is int and (isinstance(value, bool) or not isinstance(value, int)):
                also = f' or "{AUTO}"' if name in _AUTO_INT_KEYS else ""
                raise ConfigError(f"trainer config {name!r} must be an integer{also}, "
                                  f"got {value!r}")
            if want is str and not (isinstance(value, str) and value):
                raise ConfigError(f"trainer config {name!r} must be a non-empty string, "
                                  f"got {value!r}")
            if want is float and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise ConfigError(f"trainer config {name!r} must be a number, got {value!r}")
            values[name] = want(value)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        positive = ("steps", "global_batch_size", "seq_len", "vocab_size", "embed_dim",
                    "num_layers", "num_heads", "mlp_dim", "model_axis_size", "log_every")
        for name in positive:
            if getattr(self, name) < 1:
                value = getattr(self, name)
                raise ConfigError(f"trainer config {name!r} must be >= 1, got {value}")
        if self.checkpoint_storage_retries < 0 or self.checkpoint_storage_stall_seconds < 1:
            raise ConfigError("checkpoint_storage_retries must be >= 0 and "
                              "checkpoint_storage_stall_seconds >= 1")
        if self.checkpoint_restore_inflight_mib < 1:
            raise ConfigError("trainer config 'checkpoint_restore_inflight_mib' must be >= 1 "
                              f"(MiB of reads a restore may have in flight), got "
                              f"{self.checkpoint_restore_inflight_mib}")
        if self.checkpoint_snapshot_device_mib is not None and \
                self.checkpoint_snapshot_device_mib < 0:
            raise ConfigError("trainer config 'checkpoint_snapshot_device_mib' must be >= 0 "
                              "(MiB of device memory a save may stage; 0: never; "
                              f'"{AUTO}" or unset: as much as the training leaves free), got '
                              f"{self.checkpoint_snapshot_device_mib}")
        if self.devices_per_process is not None and self.devices_per_process < 1:
            raise ConfigError("trainer config 'devices_per_process' must be >= 1")
        if self.embed_dim % self.num_heads:
            raise ConfigError(
                f"embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}"
            )

    def check_devices(self, num_devices: int) -> int:
        """Return the data-axis size for `num_devices`, or explain why the config does not fit."""
        if num_devices % self.model_axis_size:
            raise ConfigError(
                f"model_axis_size={self.model_axis_size} does not divide the {num_devices} devices"
            )
        data = num_devices // self.model_axis_size
        if self.global_batch_size % data:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} cannot be split evenly over a data "
                f"axis of {data} devices ({num_devices} devices / model_axis_size "
                f"{self.model_axis_size}); choose a batch size that is a multiple of {data}"
            )
        if self.num_heads % self.model_axis_size or self.mlp_dim % self.model_axis_size:
            raise ConfigError(
                f"num_heads={self.num_heads} and mlp_dim={self.mlp_dim} must be multiples of "
                f"model_axis_size={self.model_axis_size}"
            )
        return data
