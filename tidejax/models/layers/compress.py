"""Compressed KV branches (DeepSeek-V4 CSA / HCA, V4.1 CSA2): softmax-gated pooling of groups of
tokens into compressed entries and the indexer's selection of which entries a
query attends (two-level top-k).

Position logic is for ONE sequence whose chunk covers positions start..start+t-1 (the first
n_valid of them real); a model vmaps it over the batch. Shapes: t chunk tokens, c channels,
g compressed entries, n groups the chunk touches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def pool_groups(kv, gate, ring_kv, ring_gate, start, n_valid, ratio: int, bias=None,
                overlap: bool = False):
    """Softmax-gated pooling of `ratio` consecutive tokens per group, for every group the chunk
    touches; members before the chunk come from the rings of raw projections (slot = position mod
    ring size). kv, gate [t, c]; ring_* [R, c]; bias [ratio, c] added to the gate (a learned
    position bias) or None.
    overlap (DeepSeek-V4's CSA): group w pools group w-1's first c/2 channels and its own last
    c/2 (2 * ratio members; before position 0 the members are empty), R = 2 * ratio.
    -> latents [n, c (c/2 with overlap)] float32, group ids [n], complete [n] bool."""
    t, slots = kv.shape[0], ring_kv.shape[0]
    n = t // ratio + 2
    group = start // ratio + jnp.arange(n)
    member = group[:, None] * ratio + jnp.arange(ratio)[None]  # [n, ratio] positions

    def fetch(pos):
        idx = pos - start
        inside = ((idx >= 0) & (idx < t))[..., None]
        safe, slot = jnp.clip(idx, 0, t - 1), jnp.mod(pos, slots)
        g = jnp.where(inside, gate[safe], ring_gate[slot])
        return jnp.where(inside, kv[safe], ring_kv[slot]), g if bias is None else g + bias[None]

    kv_m, gate_m = fetch(member)
    if overlap:
        width = kv.shape[-1] // 2
        kv_p, gate_p = fetch(member - ratio)
        gate_p = jnp.where((member - ratio >= 0)[..., None], gate_p, -jnp.inf)
        kv_m = jnp.concatenate([kv_p[..., :width], kv_m[..., width:]], 1)
        gate_m = jnp.concatenate([gate_p[..., :width], gate_m[..., width:]], 1)
    latent = jnp.sum(jax.nn.softmax(gate_m.astype(F32), 1) * kv_m.astype(F32), 1)
    complete = group * ratio + ratio - 1 <= start + n_valid - 1
    return latent, group, complete


def candidate_blocks(scores, newest, block: int, keep: int):
    """Level one of the two-level top-k: per query keep the `keep` best blocks of `block` entries
    (block score = max entry; the block of the newest visible entry is forced in).
    scores [t, g] with -inf where invisible; newest [t] (index of the newest visible entry, -1 when
    none) -> bool [t, g]."""
    t, g = scores.shape
    n_blocks = -(-g // block)
    padded = jnp.pad(scores, ((0, 0), (0, n_blocks * block - g)), constant_values=-jnp.inf)
    block_scores = padded.reshape(t, n_blocks, block).max(-1)
    last = jnp.floor_divide(newest, block)
    block_scores = jnp.where(jnp.arange(n_blocks)[None] == last[:, None], jnp.inf, block_scores)
    kept = selection_mask(*top_k_select(block_scores, keep), n_blocks)
    return jnp.repeat(kept, block, axis=1)[:, :g]


def top_k_select(scores, k: int):
    """The top min(k, g) scores of each row: ids [t, k'] int32 and valid [t, k'] (finite score).
    Among equal scores the lower id wins (jax.lax.top_k's rule; -0.0 is made 0.0 first, which
    top_k's total order would put below it): the indexers' ReLU ties often (a score is exactly
    0 where no index head fires), and the rule makes a query's pick the same in a prompt chunk
    and a decode step. transformers' torch.topk leaves ties unspecified."""
    scores = jnp.where(scores == 0, 0.0, scores)
    values, ids = jax.lax.top_k(scores, min(k, scores.shape[-1]))
    return ids.astype(jnp.int32), values > -jnp.inf


def selection_mask(ids, valid, g: int):
    """ids, valid [t, k] -> bool [t, g] (which entries a query may attend)."""
    t = ids.shape[0]
    return jnp.zeros((t, g), bool).at[jnp.arange(t)[:, None], ids].set(valid)
