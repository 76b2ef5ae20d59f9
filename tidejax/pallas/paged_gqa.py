"""Paged grouped-query attention (GLM-4.5) over each row's pages: decode (one query a row) and
prefill (a prompt chunk's queries). For row i, query head j (KV head j // R, R = h / g heads
sharing each) and a query at position q, over the positions p <= q of the row's pages (position
p in page block_table[i, p // page_size], row p % page_size):
    out[i, j] = softmax_p(q[i, j] . k[p, j // R] * scale) @ v[p, j // R]    (float32)
with a sliding window W > 0 (gpt-oss) over the positions q - W < p <= q only, and with sinks
(gpt-oss) one more logit sinks[j] in the softmax's denominator, attending to nothing.
tidejax.ops.paged_gqa_decode and paged_gqa_prefill pick between:

- `paged_gqa_reference` (and `paged_gqa_decode_reference`): jnp, kv.paged.gqa_attention's flash
  loop (key blocks gathered through the table up to the chunk's last position, float32, HIGHEST
  precision dots).
- `paged_gqa_triton` (and `paged_gqa_decode_triton`): paged_gqa_kernel, called through
  jax-triton on the GPU (Pallas's Triton lowering is deprecated since jax 0.11): program (row,
  KV head, query block x split) takes BQ queries x the R heads of one KV head as the rows of its
  dots and walks its split's share of the keys its rows can see (from the first block any
  row's window reaches up to its last query's position); the splits' partial sums are combined
  by log-sum-exp in jnp, the sinks with them. Dots take the pool's dtype with float32
  accumulation (bf16 pools: bf16 dots, a float32 query as two bf16 terms, the probabilities
  rounded to bf16 for the value dot, as in FlashAttention; float32 pools: IEEE float32 dots).
  Off the GPU (interpret=True, tests) the same kernel runs in Triton's interpreter on the host
  (through jax.pure_callback and torch tensors), its dots in float32 on the same rounded
  operands (the interpreter's bf16 dots are wrong). Not yet run or timed on a GPU.
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np

from tidejax.kv.paged import gqa_attention
from tidejax.pallas.triton_host import to_torch

F32 = jnp.float32
POOL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
MAX_HEAD_DIM = 256  # channels a head (k and v): a program holds [BLOCK_N, head_dim] of each
MAX_GROUP = 64  # query heads a KV head: a program's dot rows take at least one query's
ROWS = 64  # dot rows a program aims at: BQ = ROWS // R queries (at least 1) of R heads
BLOCK_N = 64  # keys a loop step (a page, part of one, or several small pages gathered)
NUM_WARPS = 4
# programs the grid aims at (two waves of the H200's 132 multiprocessors) and the fewest key
# blocks a split takes (a split writes [rows, v] float32 partials); not tuned on a GPU yet
TARGET_PROGRAMS = 264
MIN_BLOCKS_PER_SPLIT = 4


def _check_args(op, q, k_pages, v_pages, block_table, positions, sinks, window):
    """q [b, *lead, h, k] against the pools [n_pages, page_size, g, k | v], block_table [b, P],
    positions | lengths [b, *lead], sinks None or [h] and window a static int >= 0."""
    *lead, h, dk = q.shape
    n, ps, g, _ = k_pages.shape
    if (h % g or k_pages.shape[3] != dk or v_pages.shape[:3] != (n, ps, g)
            or block_table.ndim != 2 or block_table.shape[0] != lead[0]
            or positions.shape != tuple(lead)):
        raise ValueError(f"{op}: q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape}, "
                         f"block_table {block_table.shape} and positions / lengths "
                         f"{positions.shape} do not fit (q [b, (t,) h, k], pools [n_pages, "
                         f"page_size, g, k | v] with h a multiple of g, block_table [b, P])")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"{op}: k_pages {k_pages.dtype} and v_pages {v_pages.dtype} must share "
                         f"a dtype")
    if sinks is not None and sinks.shape != (h,):
        raise ValueError(f"{op}: sinks {sinks.shape} must be [h] = ({h},): a logit per query head")
    if not isinstance(window, (int, np.integer)) or window < 0:
        raise ValueError(f"{op}: window {window!r} must be a static int >= 0 (0: no window)")


def paged_gqa_reference(q, k_pages, v_pages, block_table, positions, *, scale, sinks=None,
                        window: int = 0):
    """q [b, t, h, k], k_pages [n_pages, page_size, g, k], v_pages [n_pages, page_size, g, v],
    block_table [b, P] int32, positions [b, t] int32 (a query sees positions <= its own; none,
    so zeros, when negative) -> out [b, t, h, v] float32. Reads the table's pages up to the
    chunk's last position, never the pool. sinks [h] (a logit per head in each softmax's
    denominator) and window (> 0: a query at p sees positions > p - window):
    kv.paged.gqa_attention's."""
    _check_args("paged_gqa_prefill", q, k_pages, v_pages, block_table, positions, sinks, window)
    return gqa_attention(q.astype(F32), k_pages, v_pages, block_table, positions, scale=scale,
                         sinks=sinks, window=window)


def paged_gqa_decode_reference(q, k_pages, v_pages, block_table, lengths, *, scale, sinks=None,
                               window: int = 0):
    """q [b, h, k], the pools as paged_gqa_reference's, lengths [b] int32 (a row sees its
    positions 0..length-1) -> out [b, h, v] float32, zeros for a row of length 0."""
    _check_args("paged_gqa_decode", q, k_pages, v_pages, block_table, lengths, sinks, window)
    return paged_gqa_reference(q[:, None], k_pages, v_pages, block_table,
                               (lengths - 1)[:, None], scale=scale, sinks=sinks,
                               window=window)[:, 0]


def _pow2_at_least(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def triton_supports(q, k_pages, v_pages) -> bool:
    """Whether the kernel takes these shapes here: head dims up to MAX_HEAD_DIM, up to MAX_GROUP
    query heads a KV head, bf16 or float32 pools and queries, and jax-triton installed (the GPU
    path's only way in)."""
    h, g = q.shape[-2], k_pages.shape[2]
    dtypes = {jnp.dtype(a.dtype) for a in (q, k_pages, v_pages)}
    return (max(k_pages.shape[3], v_pages.shape[3]) <= MAX_HEAD_DIM and h // g <= MAX_GROUP
            and dtypes <= set(POOL_DTYPES) and importlib.util.find_spec("jax_triton") is not None)


def choose_splits(programs: int, n_table: int, page_size: int, window: int = 0,
                  queries: int = 1) -> int:
    """Splits of each query block's key blocks (static), given the programs without splits:
    enough programs to fill the GPU, none that could not get MIN_BLOCKS_PER_SPLIT blocks of a
    full table, or of a window (its keys and a block's `queries` consecutive positions past
    them, on at most one more block than they fill)."""
    max_blocks = -(-n_table * page_size // BLOCK_N)
    if window:
        max_blocks = min(max_blocks, -(-(window + queries - 1) // BLOCK_N) + 1)
    want = -(-TARGET_PROGRAMS // max(1, programs))
    return max(1, min(want, max_blocks // MIN_BLOCKS_PER_SPLIT))


def _meta(q, k_pages, v_pages, window: int, interpret: bool) -> dict:
    t, h, dk = q.shape[1:]
    _, ps, g, dv = v_pages.shape
    r = h // g
    bq = max(1, min(ROWS // r, t))
    two_terms = k_pages.dtype == jnp.bfloat16 and q.dtype == F32
    return dict(T=t, H=h, G=g, R=r, BQ=bq, M_P=_pow2_at_least(bq * r), DK=dk,
                DK_P=_pow2_at_least(dk), DV=dv, DV_P=_pow2_at_least(dv), PS=ps, BLOCK_N=BLOCK_N,
                MIN_BLOCKS=MIN_BLOCKS_PER_SPLIT, WINDOW=int(window), Q_TERMS=2 if two_terms else 1,
                PRECISION="ieee" if interpret or k_pages.dtype == F32 else "tf32",
                DOT_F32=interpret)


def _interpreted(q, k_pages, v_pages, block_table, positions, *, n_table: int, scale: float,
                 meta: dict, grid: tuple):
    """The kernel in Triton's interpreter on the host -> (acc, top, total) float32, its
    arguments in jax-triton's order: the arrays, the scalars, then the outputs."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from tidejax.pallas.paged_gqa_kernel import paged_gqa_kernel

    b, g, s, t, r = q.shape[0], meta["G"], meta["SPLITS"], meta["T"], meta["R"]
    acc = torch.zeros((b, g, s, t, r, meta["DV"]), dtype=torch.float32)
    top = torch.zeros((b, g, s, t, r), dtype=torch.float32)
    total = torch.zeros_like(top)
    InterpretedFunction(paged_gqa_kernel.fn)[grid](
        *map(to_torch, (q, k_pages, v_pages, block_table, positions)), n_table, scale, acc, top,
        total, **meta)
    return acc.numpy(), top.numpy(), total.numpy()


def paged_gqa_triton(q, k_pages, v_pages, block_table, positions, *, scale, sinks=None,
                     window: int = 0, interpret: bool = False):
    """paged_gqa_reference's result by the Triton kernel (same shapes and arguments): the window
    in the kernel, the sinks in the combine of its splits."""
    _check_args("paged_gqa_prefill", q, k_pages, v_pages, block_table, positions, sinks, window)
    b, t, h, _ = q.shape
    n_table = block_table.shape[1]
    _, ps, g, dv = v_pages.shape
    if b * t == 0:
        return jnp.zeros((b, t, h, dv), F32)
    meta = _meta(q, k_pages, v_pages, window, interpret)
    q_blocks = -(-t // meta["BQ"])
    splits = meta["SPLITS"] = choose_splits(b * g * q_blocks, n_table, ps, window, meta["BQ"])
    grid, r = (b, g, q_blocks * splits), h // g
    shapes = (jax.ShapeDtypeStruct((b, g, splits, t, r, dv), F32),
              jax.ShapeDtypeStruct((b, g, splits, t, r), F32),
              jax.ShapeDtypeStruct((b, g, splits, t, r), F32))
    table, positions = block_table.astype(jnp.int32), positions.astype(jnp.int32)
    if interpret:
        acc, top, total = jax.pure_callback(
            functools.partial(_interpreted, n_table=n_table, scale=float(scale), meta=meta,
                              grid=grid), shapes, q, k_pages, v_pages, table, positions)
    else:
        import jax_triton

        from tidejax.pallas.paged_gqa_kernel import paged_gqa_kernel

        acc, top, total = jax_triton.triton_call(
            q, k_pages, v_pages, table, positions, n_table, float(scale),
            kernel=paged_gqa_kernel, out_shape=shapes, grid=grid, num_warps=NUM_WARPS,
            num_stages=2, **meta)
    # the splits by log-sum-exp: [b, g, S, t, r, ...] -> [b, g, t, r, ...]; a sink joins them as
    # one more logit of its head with no value, as the reference's running max and sum start
    best = jnp.max(top, axis=2)
    if sinks is not None:
        sink = sinks.astype(F32).reshape(1, g, 1, r)  # head kvh * r + j: [1, g, 1, r]
        best = jnp.maximum(best, sink)
    weight = jnp.exp(top - best[:, :, None])  # 1 for every split of a query with no keys and
    total = jnp.sum(total * weight, axis=2)  # no sink (their sums are 0)
    if sinks is not None:
        total += jnp.exp(sink - best)
    out = jnp.sum(acc * weight[..., None], axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
    return jnp.moveaxis(out, 1, 2).reshape(b, t, h, dv)  # [b, t, g, r, v] -> [b, t, h, v]


def paged_gqa_decode_triton(q, k_pages, v_pages, block_table, lengths, *, scale, sinks=None,
                            window: int = 0, interpret: bool = False):
    """paged_gqa_decode_reference's result by the Triton kernel (same shapes and arguments)."""
    _check_args("paged_gqa_decode", q, k_pages, v_pages, block_table, lengths, sinks, window)
    return paged_gqa_triton(q[:, None], k_pages, v_pages, block_table, (lengths - 1)[:, None],
                            scale=scale, sinks=sinks, window=window, interpret=interpret)[:, 0]
