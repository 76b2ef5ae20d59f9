"""Device side of the paged KV pool: writes at a sequence's positions and attention over its own
pages.

A pool leaf is [n_pages, page_size, ...]; a step's block table [b, P] lists each row's pages in
order (P is the step's bucket, tidejax.kv.pages.page_bucket: what its longest row holds), so reads
and attention cost what the sequences hold, never the pool or max_context.
"""

from __future__ import annotations

import jax.numpy as jnp

from tidejax.pallas import paged_mla_decode, paged_mla_prefill


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


def mla_attention(q_latent, q_rope, latent_pages, rope_pages, block_table, positions, *,
                  scale: float, impl: str = "auto"):
    """Multi-head latent attention over each row's pages: q_latent [b, t, h, c] (kv_b absorbed),
    q_rope [b, t, h, r]; positions [b, t] (a query sees positions <= its own) -> the attended
    latent [b, t, h, c] in the queries' dtype. Decode (t = 1) goes to the paged decode kernel,
    a prompt chunk to the paged prefill kernel (`impl` picks each kernel or its reference: the
    pages a row holds, no more)."""
    if q_latent.shape[1] == 1:
        out = paged_mla_decode(q_latent[:, 0], q_rope[:, 0], latent_pages, rope_pages,
                               block_table, positions[:, 0] + 1, scale=float(scale), impl=impl)
        return out[:, None].astype(q_latent.dtype)
    return paged_mla_prefill(q_latent, q_rope, latent_pages, rope_pages, block_table, positions,
                             scale=float(scale), impl=impl)
