"""Attention recomputed in the backward pass (model.py, `recompute_attention`): the same loss
and gradients as keeping its probabilities, without keeping them."""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tardigrade_trainer import model
from tardigrade_trainer.config import TrainerConfig

# A sequence length no other dimension has, so that the attention probabilities (batch x
# heads x position x position) are the only residuals with two axes of this length.
SEQ = 24


def _loss_and_vjp(recompute: bool) -> tuple[jax.Array, object, list[tuple[int, ...]]]:
    config = TrainerConfig(seq_len=SEQ, vocab_size=40, embed_dim=32, num_heads=2, mlp_dim=64,
                           num_layers=2, global_batch_size=3, recompute_attention=recompute)
    gpt = model.Gpt.init(config, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(gpt, eqx.is_array)
    axes = model.Axes.from_config(config)
    tokens = hax.named(jax.random.randint(jax.random.PRNGKey(1), (3, SEQ), 0, 40),
                       (hax.Axis("batch", 3), axes.Pos))
    loss, vjp = jax.vjp(lambda p: eqx.combine(p, static).loss(tokens, tokens), params)
    (grads,) = vjp(jnp.ones_like(loss))
    # The residuals the backward pass keeps are the leaves of the vjp function.
    residuals = [tuple(leaf.shape) for leaf in jax.tree_util.tree_leaves(vjp)
                 if hasattr(leaf, "shape")]
    return loss, grads, residuals


def _attention_shaped(shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    # Per example and head: the causal mask alone (position x position) is kept either way.
    return [shape for shape in shapes if list(shape).count(SEQ) >= 2 and len(shape) > 2]


@pytest.fixture(scope="module")
def both():
    return {recompute: _loss_and_vjp(recompute) for recompute in (False, True)}


def test_recomputed_attention_gives_the_same_loss_and_gradients(both):
    (kept_loss, kept_grads, _), (loss, grads, _) = both[False], both[True]
    np.testing.assert_allclose(np.asarray(loss), np.asarray(kept_loss), rtol=1e-6)
    for got, want in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(kept_grads),
                         strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_recomputed_attention_keeps_no_position_by_position_residual(both):
    assert _attention_shaped(both[False][2]), "kept attention should keep its probabilities"
    assert _attention_shaped(both[True][2]) == []


def test_recomputation_is_on_unless_the_config_turns_it_off():
    assert TrainerConfig().recompute_attention is True
    assert TrainerConfig.from_mapping({"recompute_attention": False}).recompute_attention is False
