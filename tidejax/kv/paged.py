"""Device side of the paged KV pool: writes at a sequence's positions, reads of its own pages, and
attention over them.

A pool leaf is [n_pages, page_size, ...]; a step's block table [b, P] lists each row's pages in
order (P is the step's bucket, tidejax.kv.pages.page_bucket: what its longest row holds), so reads
and attention cost what the sequences hold, never the pool or max_context.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tidejax.pallas import paged_mla_decode

HIGHEST = jax.lax.Precision.HIGHEST
QUERY_BLOCK = 256  # prefill queries attended at once: bounds the [h, queries, keys] scores
KEY_BLOCK = 512  # keys a prefill chunk attends a loop step (whole pages; at least one page)


def token_slots(block_table, positions, mask, n_pages: int, page_size: int):
    """block_table [b, P], positions / mask [b, t] -> flat pool rows [b, t] (page * page_size +
    row); masked tokens and positions past the table get n_pages * page_size, which writes drop."""
    page_index = positions // page_size
    inside = mask & (page_index < block_table.shape[1])
    page = jnp.take_along_axis(block_table, jnp.clip(page_index, 0, block_table.shape[1] - 1), axis=1)
    return jnp.where(inside, page * page_size + positions % page_size, n_pages * page_size)


def write(pool, values, slots):
    """pool [n_pages, page_size, ...] <- values [b, t, ...] at flat rows `slots` [b, t] (in place
    when the pool is donated; out-of-range rows are dropped)."""
    n, size = pool.shape[:2]
    flat = pool.reshape(n * size, *pool.shape[2:])
    flat = flat.at[slots.reshape(-1)].set(
        values.reshape(-1, *values.shape[2:]).astype(pool.dtype), mode="drop")
    return flat.reshape(pool.shape)


def gather(pool, block_table):
    """pool [n_pages, page_size, ...], block_table [b, P] -> [b, P * page_size, ...]: each row's
    positions 0.. in order."""
    pages = pool[block_table]  # [b, P, page_size, ...]
    return pages.reshape(pages.shape[0], -1, *pool.shape[2:])


def mla_attention(q_latent, q_rope, latent_pages, rope_pages, block_table, positions, *,
                  scale: float, impl: str = "auto"):
    """Multi-head latent attention over each row's pages: q_latent [b, t, h, c] (kv_b absorbed),
    q_rope [b, t, h, r]; positions [b, t] (a query sees positions <= its own) -> the attended
    latent [b, t, h, c] in the queries' dtype. Decode (t = 1) goes to the paged decode kernel
    (`impl` picks it or its reference: the pages a row holds, no more); a prefill chunk goes to
    `chunk_attention`."""
    if q_latent.shape[1] == 1:
        out = paged_mla_decode(q_latent[:, 0], q_rope[:, 0], latent_pages, rope_pages,
                               block_table, positions[:, 0] + 1, scale=float(scale), impl=impl)
        return out[:, None].astype(q_latent.dtype)
    t = q_latent.shape[1]
    if t <= QUERY_BLOCK or t % QUERY_BLOCK:
        return chunk_attention(q_latent, q_rope, latent_pages, rope_pages, block_table, positions,
                               scale)
    # a long chunk attends a block of queries at a time: [b, h, QUERY_BLOCK, KEY_BLOCK] scores
    blocks = t // QUERY_BLOCK

    def split(x):  # [b, t, ...] -> [blocks, b, QUERY_BLOCK, ...]
        return jnp.moveaxis(x.reshape(x.shape[0], blocks, QUERY_BLOCK, *x.shape[2:]), 1, 0)
    out = jax.lax.map(
        lambda q: chunk_attention(*q[:2], latent_pages, rope_pages, block_table, q[2], scale),
        (split(q_latent), split(q_rope), split(positions)))
    return jnp.moveaxis(out, 0, 1).reshape(q_latent.shape)


def chunk_attention(q_latent, q_rope, latent_pages, rope_pages, block_table, positions, scale):
    """Causal attention of a chunk's queries [b, t, h, c|r] at positions [b, t] over their rows'
    pages, a block of KEY_BLOCK keys at a time with a running max and sum (flash attention): the
    loop stops at the block holding the chunk's last position, so a chunk costs the keys it can
    see, not the table's width. Scores and sums in float32. Differentiable where the chunk is as
    long as its table (the loop's bound is then static)."""
    page_size = latent_pages.shape[1]
    per_block = max(1, KEY_BLOCK // page_size)  # pages a key block holds
    keys = per_block * page_size
    b, t, h, c = q_latent.shape
    width = block_table.shape[1]
    table = jnp.pad(block_table, ((0, 0), (0, -width % per_block)))  # padding: page 0, masked
    n_blocks = table.shape[1] // per_block
    if width * page_size > t:  # key blocks up to the last query's position (a dynamic bound)
        n_blocks = jnp.minimum((jnp.max(positions) + keys) // keys, n_blocks)
    # else the chunk is as long as its table (a full forward: scoring, training): every block,
    # a static bound, which reverse-mode differentiation needs

    def attend_block(i, carry):
        top, total, acc = carry  # [b, h, t], [b, h, t], [b, t, h, c]
        pages = jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block, axis=1)
        latent, rope = gather(latent_pages, pages), gather(rope_pages, pages)  # [b, keys, c|r]
        scores = (jnp.einsum("bthc,bsc->bhts", q_latent, latent, precision=HIGHEST,
                             preferred_element_type=jnp.float32)
                  + jnp.einsum("bthr,bsr->bhts", q_rope, rope, precision=HIGHEST,
                               preferred_element_type=jnp.float32)) * scale
        visible = i * keys + jnp.arange(keys)[None, None, :] <= positions[:, :, None]  # [b, t, s]
        scores = jnp.where(visible[:, None], scores, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
        probs = jnp.exp(scores - new_top[..., None])
        keep = jnp.exp(top - new_top)
        total = total * keep + jnp.sum(probs, axis=-1)
        acc = acc * jnp.moveaxis(keep, 1, 2)[..., None] + jnp.einsum(
            "bhts,bsc->bthc", probs.astype(latent.dtype), latent, precision=HIGHEST,
            preferred_element_type=jnp.float32)
        return new_top, total, acc

    start = (jnp.full((b, h, t), -1e30, jnp.float32), jnp.zeros((b, h, t), jnp.float32),
             jnp.zeros((b, t, h, c), jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, n_blocks, attend_block, start)
    return (acc / jnp.moveaxis(total, 1, 2)[..., None]).astype(q_latent.dtype)
