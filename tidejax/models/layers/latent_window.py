"""Latent single-KV attention over a sliding window (DeepSeek-V4 / V4.1): one latent per token is
both key and value; the last W-1 of them live in a ring (slot = position mod W-1); attention
sinks; a grouped low-rank output projection.

Position logic (ring_positions, ring_update) is for ONE sequence whose chunk covers positions
start..start+t-1, the first n_valid of them real; window_keys vmaps it over the batch.
Einsum letters: b batch, t queries, s keys, h heads, k head width, g output groups.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from tidejax.models.base import ParamSpec, declare
from tidejax.models.layers.linear import HIGHEST, linear_specs
from tidejax.ops import fp8_block_matmul
from tidejax.models.layers.norm import norm_specs

F32 = jnp.float32
PARTS = ("q_a", "q_norm", "q_b", "kv", "kv_norm", "sink", "o_a", "o_b")


def attention_specs(cfg, names: dict[str, str], dtype, norm_dtype) -> dict:
    """The declared params of latent single-KV attention with a low-rank query and a grouped
    low-rank output, under the family's `names` of PARTS: projections in `dtype`, the norms in
    `norm_dtype`, the sinks float32. The config is read by field name: hidden_size, num_heads,
    head_dim, q_lora_rank, o_groups, o_lora_rank."""
    d, h, k, q = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    rank = cfg.o_groups * cfg.o_lora_rank
    specs = {"q_a": linear_specs(q, d, ("q_lora", "embed"), dtype),
             "q_norm": norm_specs(q, "q_lora", norm_dtype),
             "q_b": linear_specs(h * k, q, ("heads", "q_lora"), dtype),
             "kv": linear_specs(k, d, (None, "embed"), dtype),  # one KV head: never split
             "kv_norm": norm_specs(k, None, norm_dtype),
             "sink": ParamSpec((h,), F32, ("heads",), init="zeros"),
             "o_a": linear_specs(rank, h * k // cfg.o_groups, (None, None), dtype),
             "o_b": linear_specs(d, rank, ("embed", None), dtype)}
    return {names[part]: specs[part] for part in PARTS}


def ring_positions(start, slots: int):
    """Position held by each ring slot before the chunk (slot = position mod slots); -1 = empty."""
    last = start - 1
    pos = last - jnp.mod(last - jnp.arange(slots), slots)
    return jnp.where(pos >= 0, pos, -1)


def ring_update(ring, new, start, n_valid):
    """ring [slots, ...] <- the latest of new [t, ...] (positions start..start+n_valid-1) per slot."""
    slots, t = ring.shape[0], new.shape[0]
    end = start + n_valid - 1
    idx = end - jnp.mod(end - jnp.arange(slots), slots) - start  # chunk index of each slot's latest
    take = (idx >= 0).reshape((slots,) + (1,) * (ring.ndim - 1))
    return jnp.where(take, new[jnp.clip(idx, 0, t - 1)], ring)


def window_keys(window, kv, positions, n_valid, sliding_window: int):
    """window [b, W-1, k] (the ring), kv [b, t, k] the chunk's latents, positions [b, t], n_valid
    [b] -> keys [b, W-1+t, k] (ring, then chunk), mask [b, t, W-1+t] (causal, within the window,
    filled slots only), the ring updated with the chunk."""
    kv = kv.astype(window.dtype)
    start = positions[:, 0]
    ring_pos = jax.vmap(ring_positions, (0, None))(start, window.shape[1])  # [b, W-1]
    keys = jnp.concatenate([window, kv], 1)
    kp = jnp.concatenate([ring_pos, positions], 1)[:, None, :]
    qp = positions[:, :, None]
    mask = (kp >= 0) & (kp <= qp) & (kp > qp - sliding_window)  # [b, t, s]
    return keys, mask, jax.vmap(ring_update)(window, kv, start, n_valid)


def softmax_with_sink(logits, sink):
    """logits [b, h, t, s] (-inf where masked), sink [h] -> probs [b, h, t, s]: a softmax over the
    keys and one learned sink logit per head, the sink's share dropped."""
    b, h, t, _ = logits.shape
    sink = jnp.broadcast_to(sink[None, :, None, None], (b, h, t, 1))
    return jax.nn.softmax(jnp.concatenate([logits, sink], -1), -1)[..., :-1]


def attend_with_sink(q, keys, mask, sink, extra=None, extra_mask=None):
    """Latent attention of q [b, t, h, k] over the window keys [b, s, k] (= values; mask [b, t, s])
    and a compressed branch's entries (None: none): per query, extra [b, t, j, k] (the entries an
    indexer picked), or shared by the chunk's queries, extra [b, g, k]; extra_mask [b, t, j | g].
    Logits scaled by k**-0.5, one softmax over both and the sink -> out [b, t, h, k] float32.
    The dots take the operands' dtype (HIGHEST precision) and accumulate in float32, the softmax
    is float32 and its probabilities meet the values in the operands' dtype: a bfloat16 model's
    attention runs on the tensor cores, its keys (FP8 / FP4 values) exact in bfloat16.

    keys are as window_keys lays them out (the ring's W-1, then the chunk at consecutive
    positions). A chunk longer than the ring is attended in bands: a query sees at most the W-1
    keys before it, so queries i in [nB, nB+B) (B = W-1) need only keys [nB, nB+2B) and the
    [t, W-1+t] logits shrink to [t, 2B]."""
    t = q.shape[1]
    ring = keys.shape[1] - t
    if 0 < ring < t:
        return _attend_banded(q, keys, mask, sink, extra, extra_mask, ring)
    return _attend_dense(q, keys, mask, sink, extra, extra_mask)


def _attend_dense(q, keys, mask, sink, extra, extra_mask):
    scale = q.shape[-1] ** -0.5
    per_query = extra is not None and extra.ndim == 4
    dot = functools.partial(jnp.einsum, precision=HIGHEST, preferred_element_type=F32)
    logits = dot("bthk,bsk->bhts", q, keys)
    logits = jnp.where(mask[:, None], logits * scale, -jnp.inf)
    if extra is not None:
        e = dot("bthk,btjk->bhtj" if per_query else "bthk,bjk->bhtj", q, extra)
        logits = jnp.concatenate([logits, jnp.where(extra_mask[:, None], e * scale, -jnp.inf)], -1)
    probs = softmax_with_sink(logits, sink).astype(keys.dtype)
    n_window = keys.shape[1]
    out = dot("bsk,bhts->bthk", keys, probs[..., :n_window])  # (XLA's CPU takes bf16 so)
    if extra is not None:
        out = out + dot("bhtj,btjk->bthk" if per_query else "bhtj,bjk->bthk",
                        probs[..., n_window:], extra)
    return out


def _attend_banded(q, keys, mask, sink, extra, extra_mask, block: int):
    """attend_with_sink with the chunk cut into bands of `block` = W-1 queries, each folded into
    the batch with its 2 * block keys (the padded tail's queries see nothing and are dropped)."""
    b, t, h, k = q.shape
    n = -(-t // block)
    pad = n * block - t

    def bands(x, fill=0):  # [b, t, ...] -> [b * n, block, ...], the tail padded with `fill`
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return x.reshape((b * n, block) + x.shape[2:])

    kb = jnp.pad(keys, ((0, 0), (0, pad), (0, 0))).reshape(b, n + 1, block, k)
    kb = jnp.concatenate([kb[:, :-1], kb[:, 1:]], 2).reshape(b * n, 2 * block, k)
    m = jnp.pad(mask, ((0, 0), (0, pad), (0, pad))).reshape(b, n, block, n + 1, block)
    diag = jnp.arange(n)
    m = jnp.concatenate([m[:, diag, :, diag], m[:, diag, :, diag + 1]], -1)  # [n, b, B, 2B]
    m = jnp.swapaxes(m, 0, 1).reshape(b * n, block, 2 * block)
    if extra is not None:
        extra = bands(extra) if extra.ndim == 4 else jnp.repeat(extra, n, axis=0)
        extra_mask = bands(extra_mask, False)
    out = _attend_dense(bands(q), kb, m, sink, extra, extra_mask)
    return out.reshape(b, n * block, h, k)[:, :t]


class GroupedLowRank(nn.Module):
    """out [b, t, h, k] -> [b, t, groups * rank]: the heads split into `groups`, each projected by
    its own block of the weight [groups * rank, h * k / groups] (the output's first, low-rank half).
    A weight kept FP8 (a "scale" beside it: models.loading.fp8_specs) is read as stored, a group
    at a time through fp8_block_matmul, as a Linear's is: dequantized it would be twice the bytes
    a decode step reads (for V4.1-Flash 67 of 34 MB a layer)."""

    groups: int
    rank: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, out):
        b, t = out.shape[:2]
        x = out.reshape(b, t, self.groups, -1)  # [b, t, g, i]
        p = declare(self, linear_specs(self.groups * self.rank, x.shape[-1], (None, None),
                                       self.dtype))
        w = p["weight"].reshape(self.groups, self.rank, -1)  # [g, o, i]
        if not self.has_variable("params", "scale"):
            grouped = jnp.einsum("btgi,goi->btgo", x, w.astype(x.dtype), precision=HIGHEST)
            return grouped.reshape(b, t, -1)
        scales = self.get_variable("params", "scale")  # [g * o / bo, i / bi]
        bo, bi = p["weight"].shape[0] // scales.shape[0], p["weight"].shape[1] // scales.shape[1]
        rows = math.gcd(bo, self.rank)  # a block of rows inside one group: its scales repeated
        scales = jnp.repeat(scales, bo // rows, axis=0).reshape(self.groups, self.rank // rows, -1)
        grouped = jax.vmap(lambda xg, wg, sg: fp8_block_matmul(xg, wg, sg, (rows, bi)),
                           in_axes=(2, 0, 0), out_axes=2)(x, w, scales)
        return grouped.reshape(b, t, -1)
