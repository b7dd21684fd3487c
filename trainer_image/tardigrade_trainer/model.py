"""A tiny GPT-style language model written with haliax named axes."""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from tardigrade_trainer.config import TrainerConfig

# Logical axis names; mesh.py maps them onto the physical mesh axes.
BATCH = "batch"
POS = "position"
KPOS = "key_position"
EMBED = "embed"
HEADS = "heads"
HEAD_SIZE = "head_size"
MLP = "mlp"
VOCAB = "vocab"


@dataclasses.dataclass(frozen=True)
class Axes:
    Pos: Axis
    KPos: Axis
    Embed: Axis
    Heads: Axis
    HeadSize: Axis
    Mlp: Axis
    Vocab: Axis

    @classmethod
    def from_config(cls, config: TrainerConfig) -> Axes:
        return cls(
            Pos=Axis(POS, config.seq_len),
            KPos=Axis(KPOS, config.seq_len),
            Embed=Axis(EMBED, config.embed_dim),
            Heads=Axis(HEADS, config.num_heads),
            HeadSize=Axis(HEAD_SIZE, config.embed_dim // config.num_heads),
            Mlp=Axis(MLP, config.mlp_dim),
            Vocab=Axis(VOCAB, config.vocab_size),
        )


def _attention(axes: Axes, q: NamedArray, k: NamedArray, v: NamedArray,
               mask: NamedArray) -> NamedArray:
    return hnn.attention.dot_product_attention(axes.KPos, axes.HeadSize, q, k, v, mask=mask)


class Block(eqx.Module):
    ln1: hnn.LayerNorm
    qkv: hnn.Linear
    out: hnn.Linear
    ln2: hnn.LayerNorm
    up: hnn.Linear
    down: hnn.Linear
    axes: Axes = eqx.field(static=True)
    # The attention probabilities (batch x heads x position x position, per layer) are the
    # largest thing the backward pass keeps: at 184M, batch 32 x 512 on a TPU v5e they took
    # about 12 of the chip's 15.7 GiB, leaving no room to stage a save (checkpoint/staging.py).
    # Recomputed in the backward pass instead, for a few percent more FLOPs.
    recompute_attention: bool = eqx.field(static=True)

    @staticmethod
    def init(axes: Axes, *, key: jax.Array, recompute_attention: bool) -> Block:
        k_qkv, k_out, k_up, k_down = jax.random.split(key, 4)
        Qkv = Axis("qkv", 3)
        return Block(
            ln1=hnn.LayerNorm.init(axes.Embed),
            qkv=hnn.Linear.init(axes.Embed, (Qkv, axes.Heads, axes.HeadSize), key=k_qkv),
            out=hnn.Linear.init((axes.Heads, axes.HeadSize), axes.Embed, key=k_out),
            ln2=hnn.LayerNorm.init(axes.Embed),
            up=hnn.Linear.init(axes.Embed, axes.Mlp, key=k_up),
            down=hnn.Linear.init(axes.Mlp, axes.Embed, key=k_down),
            axes=axes,
            recompute_attention=recompute_attention,
        )

    def __call__(self, x: NamedArray, mask: NamedArray) -> NamedArray:
        a = self.axes
        qkv = self.qkv(self.ln1(x))
        q = qkv["qkv", 0]
        k = qkv["qkv", 1].rename({a.Pos.name: a.KPos.name})
        v = qkv["qkv", 2].rename({a.Pos.name: a.KPos.name})
        attend = functools.partial(_attention, a)
        if self.recompute_attention:
            attend = jax.checkpoint(attend)
        attn = attend(q, k, v, mask)
        x = x + self.out(attn)
        return x + self.down(hnn.gelu(self.up(self.ln2(x))))


class Gpt(eqx.Module):
    embed: hnn.Embedding
    pos_embed: NamedArray
    blocks: list[Block]
    ln_f: hnn.LayerNorm
    axes: Axes = eqx.field(static=True)

    @staticmethod
    def init(config: TrainerConfig, *, key: jax.Array) -> Gpt:
        axes = Axes.from_config(config)
        k_embed, k_pos, *k_blocks = jax.random.split(key, 2 + config.num_layers)
        return Gpt(
            embed=hnn.Embedding.init(axes.Vocab, axes.Embed, key=k_embed),
            pos_embed=hax.random.normal(k_pos, (axes.Pos, axes.Embed)) * 0.02,
            blocks=[Block.init(axes, key=k, recompute_attention=config.recompute_attention)
                    for k in k_blocks],
            ln_f=hnn.LayerNorm.init(axes.Embed),
            axes=axes,
        )

    def logits(self, tokens: NamedArray) -> NamedArray:
        a = self.axes
        x = self.embed(tokens) + self.pos_embed
        mask = hnn.attention.causal_mask(a.Pos, a.KPos)
        for block in self.blocks:
            x = block(x, mask)
        # Tied output embedding keeps the parameter count (and checkpoint) small.
        return hax.dot(self.ln_f(x), self.embed.weight, axis=a.Embed)

    def loss(self, tokens: NamedArray, targets: NamedArray) -> jax.Array:
        logits = self.logits(tokens).astype(jnp.float32)
        targets_1h = hax.nn.one_hot(targets, self.axes.Vocab, dtype=logits.dtype)
        loss = hnn.cross_entropy_loss(logits, self.axes.Vocab, targets_1h, reduction=hax.mean)
        return loss.scalar() if isinstance(loss, NamedArray) else loss
