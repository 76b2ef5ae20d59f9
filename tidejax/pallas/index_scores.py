"""The lightning indexer's scores over a paged key cache (DeepSeek-V4.1's CSA2 indexer): which
compressed entries each query ranks highest, read through the row's block table.

For row i, query j and entry g of row i (entry g lives in page block_table[i, g // rows], at row
g % rows of that page), over the index heads h:
    scores[i, j, g] = sum_h weights[i, j, h] * relu(q[i, j, h] . keys[g]) * scale    (float32)
for g < counts[i, j] (the entries the query sees), -inf past them and over the rest of the table.

The Pallas GPU kernel (Triton lowering; interpret mode off the GPU) and the jnp reference (runs
everywhere) keep one contract; tidejax.ops.paged_index_scores picks between them. Neither reads
the pool past the P pages of each row's table; the reference reads all P (its callers size P by
what the rows hold), the kernel none past each query's count (its decode tables may be
max_context wide).

The kernel: program (entry block, query, row) gathers `bk` keys of the row through the table
(a block of contiguous rows of one page, or rows of several small pages; `attention._key_rows`),
dots them with the query's index heads (heads padded to a dot's 16 rows, zero weights), and
writes their weighted ReLU sum; a block past the query's count writes -inf without reading. Dots
take the pool's dtype with float32 accumulation (a float32 query over a bf16 pool enters as two
bf16 terms; V4.1's FP4-quantized queries and keys are exact in bf16, so their products are too).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tidejax.pallas.attention import POOL_DTYPES, _dot_t, _key_rows, _pow2, dot_terms

HIGHEST = jax.lax.Precision.HIGHEST
F32 = jnp.float32
# (entries a block bk, num_warps, num_stages)
TILE = (64, 4, 2)
MIN_HEADS = 16  # rows of a Triton dot: fewer index heads are padded (with zero weights)


def _check_args(q, weights, key_pages, block_table, counts):
    """q [b, t, i, k], weights [b, t, i], key_pages [n_pages, rows, k], block_table [b, P],
    counts [b, t]."""
    if q.ndim != 4 or key_pages.ndim != 3:
        raise ValueError(f"paged_index_scores: q {tuple(q.shape)} and key_pages "
                         f"{tuple(key_pages.shape)}, expected [b, t, heads, k] and [n_pages, rows, k]")
    b, t, i, k = q.shape
    want = {"weights": (weights.shape, (b, t, i)), "counts": (counts.shape, (b, t)),
            "key_pages": (key_pages.shape[2:], (k,))}
    for name, (got, expected) in want.items():
        if tuple(got) != expected:
            raise ValueError(f"paged_index_scores: {name} has shape {tuple(got)}, expected "
                             f"{expected} (q {tuple(q.shape)})")
    if block_table.ndim != 2 or block_table.shape[0] != b:
        raise ValueError(f"paged_index_scores: block_table has shape {tuple(block_table.shape)}, "
                         f"expected [{b}, P]")


def pallas_supports(q, key_pages) -> bool:
    """Whether the kernel takes these shapes: key width a power of two >= 16, rows a page a power
    of two, bf16 or float32 pools and queries."""
    k, rows = q.shape[-1], key_pages.shape[1]
    dtypes = {jnp.dtype(a.dtype) for a in (q, key_pages)}
    return _pow2(k) and k >= 16 and _pow2(rows) and dtypes <= set(POOL_DTYPES)


def paged_index_scores_reference(q, weights, key_pages, block_table, counts, *, scale):
    """q [b, t, i, k], weights [b, t, i], key_pages [n_pages, rows, k], block_table [b, P] int32,
    counts [b, t] int32 -> scores [b, t, P * rows] float32 (module docstring).

    Gathers each row's P pages ([b, P * rows, k]), then float32 throughout (HIGHEST precision
    dots), one index head at a time ([b, t, P * rows] at once, never [b, t, i, P * rows])."""
    _check_args(q, weights, key_pages, block_table, counts)
    b, n_table = block_table.shape
    _, rows, k = key_pages.shape
    keys = jnp.asarray(key_pages)[block_table].reshape(b, n_table * rows, k).astype(F32)

    def add_head(acc, head):
        q_h, w_h = head  # [b, t, k], [b, t]
        s = jnp.einsum("btk,bgk->btg", q_h, keys, precision=HIGHEST)
        return acc + w_h[..., None] * (jax.nn.relu(s) * scale), None

    scores, _ = jax.lax.scan(add_head, jnp.zeros((b, q.shape[1], n_table * rows), F32),
                             (jnp.moveaxis(q.astype(F32), 2, 0),
                              jnp.moveaxis(weights.astype(F32), 2, 0)))
    visible = jnp.arange(n_table * rows)[None, None] < counts[..., None]
    return jnp.where(visible, scores, -jnp.inf)


def _scores_kernel(table_ref, counts_ref, *refs, bk, rows, n_table, scale, terms):
    """Refs: table [b, P], counts [b, t], q terms [b, t, hp, k] (1 or 2), weights [b, t, hp],
    keys [n_pages * rows, k] -> out [b, t, Gp] (Gp: P * rows rounded up to bk)."""
    q_refs, (w_ref, keys_ref, out_ref) = refs[:terms], refs[terms:]
    block, query, seq = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = block * bk
    count = counts_ref[seq, query]
    span = pl.ds(pl.multiple_of(start, bk), bk)

    @pl.when(start < count)
    def _():
        hp, k = q_refs[0].shape[2], keys_ref.shape[1]
        pos, at = _key_rows(table_ref, seq, start, bk, rows, n_table)
        keys = keys_ref[at, pl.ds(0, k)]  # [bk, k]
        s = sum(_dot_t(ref[seq, query, pl.ds(0, hp), pl.ds(0, k)], keys) for ref in q_refs)
        w = w_ref[seq, query, pl.ds(0, hp)]  # [hp]
        scores = jnp.sum(w[:, None] * (jnp.maximum(s, 0.0) * scale), axis=0)  # [bk]
        out_ref[seq, query, span] = jnp.where(pos < count, scores, -jnp.inf)

    @pl.when(start >= count)
    def _():
        out_ref[seq, query, span] = jnp.full((bk,), -jnp.inf, F32)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "tile"))
def paged_index_scores_pallas(q, weights, key_pages, block_table, counts, *, scale: float,
                              interpret: bool = False, tile=None):
    """Same contract as `paged_index_scores_reference`; scale a Python float; tile (bk, num_warps,
    num_stages) to override TILE (benchmarks)."""
    from jax.experimental.pallas import triton as plgpu  # here: the Triton lowering loads on use

    from tidejax.pallas import triton_offsets  # noqa: F401  (64-bit offsets for 2**31+ element refs)

    _check_args(q, weights, key_pages, block_table, counts)
    if not pallas_supports(q, key_pages):
        raise ValueError(f"paged_index_scores(impl='pallas'): shapes the kernel does not take: q "
                         f"{q.shape} {q.dtype}, key_pages {key_pages.shape} {key_pages.dtype}")
    bk, num_warps, num_stages = tile or TILE
    if not _pow2(bk) or bk < 16:
        raise ValueError(f"paged_index_scores: tile {tile}: bk must be a power of two >= 16")
    b, t, i, k = q.shape
    n, rows, _ = key_pages.shape
    n_table = block_table.shape[1]
    width = n_table * rows
    padded = -(-width // bk) * bk
    hp = max(MIN_HEADS, 1 << (i - 1).bit_length())
    q = jnp.pad(q, ((0, 0), (0, 0), (0, hp - i), (0, 0)))
    weights = jnp.pad(weights.astype(F32), ((0, 0), (0, 0), (0, hp - i)))  # padded heads weigh 0
    qs = dot_terms(q, key_pages.dtype)
    out = pl.pallas_call(
        functools.partial(_scores_kernel, bk=bk, rows=rows, n_table=n_table, scale=float(scale),
                          terms=len(qs)),
        out_shape=jax.ShapeDtypeStruct((b, t, padded), F32),
        grid=(padded // bk, t, b),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_index_scores",
    )(block_table.astype(jnp.int32), jnp.clip(counts.astype(jnp.int32), 0, width), *qs, weights,
      key_pages.reshape(n * rows, k))
    return out[..., :width]
