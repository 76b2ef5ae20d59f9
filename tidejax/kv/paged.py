"""Device side of the paged KV pool: writes at a sequence's positions, reads of its own pages, and
GQA's jnp attention (the reference of the paged GQA kernel) and sparse MLA over picked entries
(no kernel). The paged kernels' ops (MLA and GQA attention, index scores) are tidejax.ops.

A pool leaf is [n_pages, rows, ...]: `rows` entries a page, page_size of them for per-token keys
(MLA's latent), fewer for a leaf that keeps one entry per `ratio` tokens (DeepSeek-V4.1's
compressed entries: page_size // ratio). A step's block table [b, P] lists each row's pages in
order, and one table addresses every leaf. P is max_context's pages where every read goes up to
each row's length (the MLA prefill paths, the MLA decode kernel, GQA, the indexer's decode
kernel), so those cost what the sequences hold, never the table, the pool or max_context; a
power of two of the pages the rows need where a path reads the whole table (the MLA decode
reference, the indexer scores' reference and their prefill). The family chooses
(models.base.Family.table_widths, by tidejax.ops.reads_by_length).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


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


QUERY_BLOCK = 64  # queries whose selected entries sparse_mla_attention gathers at once


def sparse_mla_attention(q_latent, q_rope, latent_pages, rope_pages, block_table, ids, valid, *,
                         scale: float):
    """MLA over the entries each query selected (DSA; jnp): q_latent [b, t, h, c], q_rope
    [b, t, h, r]; ids, valid [b, t, k]: each query's entry ids and which of them count -> the
    attended latent [b, t, h, c] in the queries' dtype (zeros for a query with none).

    Only the selected entries are read from the pool, by id through the table (gather_rows),
    QUERY_BLOCK queries at a time: a step costs t x k entries, never the row's pages."""
    b, t, h, c = q_latent.shape
    f32 = jnp.float32

    def attend(block):  # [b, n, ...] queries, ids and valid of one block
        ql, qr, bid, ok = block
        latent = gather_rows(latent_pages, block_table, bid).astype(f32)  # [b, n, k, c]
        rope = gather_rows(rope_pages, block_table, bid).astype(f32)  # [b, n, k, r]
        scores = (jnp.einsum("bnhc,bnkc->bnhk", ql.astype(f32), latent, precision=HIGHEST)
                  + jnp.einsum("bnhr,bnkr->bnhk", qr.astype(f32), rope, precision=HIGHEST))
        scores = jnp.where(ok[:, :, None], scores * scale, -jnp.inf)
        top = jnp.max(scores, axis=-1, keepdims=True)
        probs = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))
        total = jnp.sum(probs, axis=-1, keepdims=True)
        probs = probs / jnp.where(total > 0, total, 1.0)
        return jnp.einsum("bnhk,bnkc->bnhc", probs, latent, precision=HIGHEST)

    n = -(-t // QUERY_BLOCK)
    pad = n * QUERY_BLOCK - t if n > 1 else 0
    blocks = [jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
              for a in (q_latent, q_rope, ids, valid)]
    if n > 1:  # [n, b, QUERY_BLOCK, ...] through lax.map
        split = [jnp.moveaxis(a.reshape(b, n, QUERY_BLOCK, *a.shape[2:]), 1, 0) for a in blocks]
        out = jax.lax.map(attend, tuple(split))
        out = jnp.moveaxis(out, 0, 1).reshape(b, n * QUERY_BLOCK, h, c)[:, :t]
    else:
        out = attend(tuple(blocks))
    return out.astype(q_latent.dtype)


KEY_BLOCK = 512  # keys the GQA attention attends a loop step (whole pages; at least one page)


def gqa_attention(q, k_pages, v_pages, block_table, positions, *, scale: float, sinks=None,
                  window: int = 0):
    """Grouped-query attention over each row's pages (jnp; the reference of the paged GQA kernel,
    pallas.paged_gqa): q [b, t, h, k];
    k_pages, v_pages [n_pages, page_size, g, k] (g KV heads, each serving h / g query heads);
    block_table [b, P]; positions [b, t] (a query sees positions <= its own) -> out [b, t, h, k]
    in the queries' dtype. sinks [h] (gpt-oss): a logit per head in each softmax's denominator
    that attends to nothing; window > 0: a query at q sees only positions > q - window.

    Flash attention: KEY_BLOCK keys at a time gathered page by page from the table, a running max
    and sum in float32 (HIGHEST precision dots); the loop stops at the block holding the last
    query's position, so a step costs the keys its rows hold, never the pool or max_context."""
    b, t, h, dk = q.shape
    _, page_size, g, dv = v_pages.shape
    if h % g or k_pages.shape[:3] != v_pages.shape[:3] or k_pages.shape[3] != dk:
        raise ValueError(f"gqa_attention: q {q.shape}, k_pages {k_pages.shape} and v_pages "
                         f"{v_pages.shape} do not fit (heads a multiple of the KV heads)")
    f32 = jnp.float32
    per_block = max(1, KEY_BLOCK // page_size)  # pages a key block holds
    keys = per_block * page_size
    width = block_table.shape[1]
    table = jnp.pad(block_table, ((0, 0), (0, -width % per_block)))  # padding: page 0, masked
    n_blocks = jnp.clip(jnp.max(positions) // keys + 1, 0, table.shape[1] // per_block)
    # a window's first block: none before the lowest query's window
    first = jnp.maximum(jnp.min(positions) - window + 1, 0) // keys if window else 0
    qg = q.astype(f32).reshape(b, t, g, h // g, dk)  # [b, t, g, r, k]: query heads by KV head

    def attend_block(i, carry):
        top, total, acc = carry  # [b, g, r, t], [b, g, r, t], [b, t, g, r, v]
        pages = jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block, axis=1)
        k = k_pages[pages].reshape(b, keys, g, dk).astype(f32)  # [b, s, g, k]
        v = v_pages[pages].reshape(b, keys, g, dv).astype(f32)
        scores = jnp.einsum("btgrk,bsgk->bgrts", qg, k, precision=HIGHEST) * scale
        key_pos = i * keys + jnp.arange(keys)[None, None, :]
        visible = key_pos <= positions[:, :, None]  # [b, t, s]
        if window:
            visible &= key_pos > positions[:, :, None] - window
        scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
        probs = jnp.exp(scores - new_top[..., None])
        keep = jnp.exp(top - new_top)
        acc = acc * jnp.moveaxis(keep, 3, 1)[..., None] + jnp.einsum(
            "bgrts,bsgv->btgrv", probs, v, precision=HIGHEST)
        return new_top, total * keep + jnp.sum(probs, axis=-1), acc

    if sinks is None:
        top, total = jnp.full((b, g, h // g, t), -1e30, f32), jnp.zeros((b, g, h // g, t), f32)
    else:  # the sink enters as a key of its own (logit sink, value 0) before the first block
        top = jnp.broadcast_to(sinks.astype(f32).reshape(1, g, h // g, 1), (b, g, h // g, t))
        total = jnp.ones((b, g, h // g, t), f32)
    start = (top, total, jnp.zeros((b, t, g, h // g, dv), f32))
    _, total, acc = jax.lax.fori_loop(first, n_blocks, attend_block, start)
    total = jnp.moveaxis(total, 3, 1)[..., None]  # [b, t, g, r, 1]
    out = acc / jnp.where(total > 0, total, 1.0)
    return out.reshape(b, t, h, dv).astype(q.dtype)
