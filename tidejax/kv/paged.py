"""Device side of the paged KV pool: writes at a sequence's positions and attention over its own
pages.

A pool leaf is [n_pages, rows, ...]: `rows` entries a page, page_size of them for per-token keys
(MLA's latent), fewer for a leaf that keeps one entry per `ratio` tokens (DeepSeek-V4.1's
compressed entries: page_size // ratio). A step's block table [b, P] lists each row's pages in
order (P is the step's bucket, tidejax.kv.pages.page_bucket: what its longest row holds), and one
table addresses every leaf, so reads and attention cost what the sequences hold, never the pool or
max_context.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tidejax.pallas import paged_index_scores, paged_mla_decode, paged_mla_prefill


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedCache:
    """A paged family's generation cache: `pages`, its pool (a pytree of leaves [n_pages, rows,
    ...] that rows reach through block tables), and `lanes`, its fixed-size rows per decode lane
    (a pytree of leaves [lanes, ...]: DeepSeek-V4.1's window rings and group buffers; None for a
    family that keeps none). A prompt chunk runs on its lane's slice of `lanes`; a preempted
    sequence saves its pages and its lane's rows."""

    pages: Any
    lanes: Any = None


def token_slots(block_table, positions, mask, n_pages: int, page_size: int):
    """block_table [b, P], positions / mask [b, t] -> flat pool rows [b, t] (page * page_size +
    row); masked tokens and positions past the table get n_pages * page_size, which writes drop.
    For a leaf of one entry per `ratio` tokens, positions are entry ids and page_size the
    entries a page holds."""
    page_index = positions // page_size
    inside = mask & (page_index < block_table.shape[1])
    page = jnp.take_along_axis(block_table, jnp.clip(page_index, 0, block_table.shape[1] - 1), axis=1)
    return jnp.where(inside, page * page_size + positions % page_size, n_pages * page_size)


def write(pool, values, slots):
    """pool [n_pages, rows, ...] <- values [b, t, ...] at flat rows `slots` [b, t] (in place
    when the pool is donated; out-of-range rows are dropped)."""
    n, size = pool.shape[:2]
    flat = pool.reshape(n * size, *pool.shape[2:])
    flat = flat.at[slots.reshape(-1)].set(
        values.reshape(-1, *values.shape[2:]).astype(pool.dtype), mode="drop")
    return flat.reshape(pool.shape)


def gather(pool, block_table):
    """pool [n_pages, rows, ...], block_table [b, P] -> [b, P * rows, ...]: each row's entries
    0.. in order."""
    pages = pool[block_table]  # [b, P, page_size, ...]
    return pages.reshape(pages.shape[0], -1, *pool.shape[2:])


def gather_rows(pool, block_table, ids):
    """pool [n_pages, rows, ...], block_table [b, P], ids [b, ...] entry ids of each row (entry
    g in page block_table[row, g // rows], row g % rows) -> [b, ..., ...]: only the entries asked
    for (DeepSeek-V4.1's top-k picks), never a copy of the row's pages."""
    rows = pool.shape[1]
    flat = ids.reshape(ids.shape[0], -1)
    page = jnp.take_along_axis(block_table, jnp.clip(flat // rows, 0, block_table.shape[1] - 1),
                               axis=1)
    return pool[page, flat % rows].reshape(*ids.shape, *pool.shape[2:])


def index_scores(q, weights, key_pages, block_table, counts, *, scale: float, impl: str = "auto"):
    """A lightning indexer's scores of a chunk's queries over their rows' paged keys: q [b, t, i,
    k], weights [b, t, i], key_pages [n_pages, rows, k], counts [b, t] (the entries 0.. each
    query sees) -> [b, t, P * rows] float32, -inf past each count. Decode steps go to the paged
    kernel, `impl` permitting (pallas.paged_index_scores)."""
    return paged_index_scores(q, weights, key_pages, block_table, counts, scale=float(scale),
                              impl=impl)


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
