"""A deterministic synthetic token stream: the batch of step k depends only on (seed, k).

Each sequence is an arithmetic progression modulo the vocabulary with a random start and
stride, so a small model can learn it and the loss visibly falls. Every host generates the
whole (small) global batch and keeps the rows its devices hold, so the stream is independent
of the process count.
"""

from __future__ import annotations

import haliax as hax
import jax
import numpy as np

from tardigrade_trainer import model
from tardigrade_trainer.config import TrainerConfig


def global_batch(config: TrainerConfig, step: int) -> np.ndarray:
    """Tokens of shape (global_batch_size, seq_len + 1) for `step` (1-based)."""
    rng = np.random.default_rng([config.seed, step])
    b, t, v = config.global_batch_size, config.seq_len + 1, config.vocab_size
    start = rng.integers(0, v, size=(b, 1))
    stride = rng.integers(1, min(v, 8), size=(b, 1))
    return ((start + stride * np.arange(t)[None, :]) % v).astype(np.int32)


def sharded_batch(
    config: TrainerConfig, step: int, sharding: jax.sharding.Sharding
) -> tuple[hax.NamedArray, hax.NamedArray]:
    tokens = global_batch(config, step)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    shape = inputs.shape
    axes = (hax.Axis(model.BATCH, shape[0]), hax.Axis(model.POS, shape[1]))
    make = jax.make_array_from_callback
    x = make(shape, sharding, lambda idx: inputs[idx])
    y = make(shape, sharding, lambda idx: targets[idx])
    return hax.named(x, axes), hax.named(y, axes)
