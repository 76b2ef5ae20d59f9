"""Paged grouped-query decode attention (GLM-4.5): one query token a row over the row's pages.
For row i, query head j (KV head j // R, R = h / g heads sharing each) and the positions
p < lengths[i] of its pages (position p in page block_table[i, p // page_size], row
p % page_size):
    out[i, j] = softmax_p(q[i, j] . k[p, j // R] * scale) @ v[p, j // R]    (float32)
tidejax.ops.paged_gqa_decode picks between:

- `paged_gqa_decode_reference`: jnp, kv.paged.gqa_attention's flash loop (key blocks gathered
  through the table up to the longest row, float32, HIGHEST precision dots) for one query a row.
- `paged_gqa_decode_triton`: gqa_decode_kernel, called through jax-triton on the GPU (Pallas's
  Triton lowering is deprecated since jax 0.11): flash-decoding, program (row, KV head, split)
  takes the R heads of one KV head as the rows of its dots and walks its split's share of the
  row's keys up to the row's length; the splits' partial sums are combined by log-sum-exp in jnp.
  Dots take the pool's dtype with float32 accumulation (bf16 pools: bf16 dots, a float32 query
  as two bf16 terms, the probabilities rounded to bf16 for the value dot, as in FlashAttention;
  float32 pools: IEEE float32 dots). Off the GPU (interpret=True, tests) the same kernel runs in
  Triton's interpreter on the host (through jax.pure_callback and torch tensors).
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np

from tidejax.kv.paged import gqa_attention

F32 = jnp.float32
POOL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
MAX_HEAD_DIM = 256  # channels a head (k and v): a program holds [BLOCK_N, head_dim] of each
MAX_GROUP = 64  # query heads a KV head: a program's dot rows
BLOCK_N = 64  # keys a loop step (a page, part of one, or several small pages gathered)
NUM_WARPS = 4
# programs the grid aims at (two waves of the H200's 132 multiprocessors) and the fewest key
# blocks a split takes (a split writes [R, dv] float32 partials); not tuned on a GPU yet
TARGET_PROGRAMS = 264
MIN_BLOCKS_PER_SPLIT = 4


def _check_args(q, k_pages, v_pages, block_table, lengths):
    b, h, dk = q.shape
    n, ps, g, _ = k_pages.shape
    if (h % g or k_pages.shape[3] != dk or v_pages.shape[:3] != (n, ps, g)
            or block_table.ndim != 2 or block_table.shape[0] != b or lengths.shape != (b,)):
        raise ValueError(f"paged_gqa_decode: q {q.shape}, k_pages {k_pages.shape}, v_pages "
                         f"{v_pages.shape}, block_table {block_table.shape} and lengths "
                         f"{lengths.shape} do not fit (q [b, h, k], pools [n_pages, page_size, g, "
                         f"k | v] with h a multiple of g, block_table [b, P], lengths [b])")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"paged_gqa_decode: k_pages {k_pages.dtype} and v_pages {v_pages.dtype} "
                         f"must share a dtype")


def paged_gqa_decode_reference(q, k_pages, v_pages, block_table, lengths, *, scale):
    """q [b, h, k], k_pages [n_pages, page_size, g, k], v_pages [n_pages, page_size, g, v],
    block_table [b, P] int32, lengths [b] int32 -> out [b, h, v] float32. Rows of length 0 give
    zeros; reads the table's pages up to the longest row, never the pool."""
    _check_args(q, k_pages, v_pages, block_table, lengths)
    positions = (lengths - 1)[:, None]  # the query's own position: it sees 0..length-1
    return gqa_attention(q.astype(F32)[:, None], k_pages, v_pages, block_table, positions,
                         scale=scale)[:, 0]


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


def choose_splits(b: int, g: int, n_table: int, page_size: int) -> int:
    """Splits of each row's key blocks (static): enough programs to fill the GPU, none that could
    not get MIN_BLOCKS_PER_SPLIT blocks of a full table."""
    max_blocks = -(-n_table * page_size // BLOCK_N)
    want = -(-TARGET_PROGRAMS // max(1, b * g))
    return max(1, min(want, max_blocks // MIN_BLOCKS_PER_SPLIT))


def _meta(q, k_pages, v_pages, splits: int, interpret: bool) -> dict:
    h, dk = q.shape[1:]
    _, ps, g, dv = v_pages.shape
    two_terms = k_pages.dtype == jnp.bfloat16 and q.dtype == F32
    return dict(H=h, G=g, R=h // g, R_P=_pow2_at_least(h // g), DK=dk, DK_P=_pow2_at_least(dk),
                DV=dv, DV_P=_pow2_at_least(dv), PS=ps, BLOCK_N=BLOCK_N, SPLITS=splits,
                MIN_BLOCKS=MIN_BLOCKS_PER_SPLIT, Q_TERMS=2 if two_terms else 1,
                PRECISION="ieee" if interpret or k_pages.dtype == F32 else "tf32",
                DOT_F32=interpret)


def _torch(a: np.ndarray):
    """A host array as a writable torch tensor (bf16 through its bits: numpy has no bf16)."""
    import torch

    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(np.array(a).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def _interpreted(q, k_pages, v_pages, block_table, lengths, *, scale: float, meta: dict):
    """The kernel in Triton's interpreter on the host -> (acc, top, total) float32."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from tidejax.pallas.gqa_decode_kernel import gqa_decode_kernel

    b, g, splits, r, dv = q.shape[0], meta["G"], meta["SPLITS"], meta["R"], meta["DV"]
    acc = torch.zeros((b, g, splits, r, dv), dtype=torch.float32)
    top = torch.zeros((b, g, splits, r), dtype=torch.float32)
    total = torch.zeros_like(top)
    InterpretedFunction(gqa_decode_kernel.fn)[(b, g, splits)](
        _torch(q), _torch(k_pages), _torch(v_pages), _torch(block_table.astype(np.int32)),
        _torch(lengths.astype(np.int32)), acc, top, total, block_table.shape[1], float(scale),
        **meta)
    return acc.numpy(), top.numpy(), total.numpy()


def paged_gqa_decode_triton(q, k_pages, v_pages, block_table, lengths, *, scale,
                            interpret: bool = False):
    """paged_gqa_decode_reference's result by the Triton kernel (same shapes)."""
    _check_args(q, k_pages, v_pages, block_table, lengths)
    b, h, _ = q.shape
    n_table = block_table.shape[1]
    _, ps, g, dv = v_pages.shape
    if b == 0:
        return jnp.zeros((0, h, dv), F32)
    splits = choose_splits(b, g, n_table, ps)
    meta = _meta(q, k_pages, v_pages, splits, interpret)
    r = h // g
    shapes = (jax.ShapeDtypeStruct((b, g, splits, r, dv), F32),
              jax.ShapeDtypeStruct((b, g, splits, r), F32),
              jax.ShapeDtypeStruct((b, g, splits, r), F32))
    table, lengths = block_table.astype(jnp.int32), lengths.astype(jnp.int32)
    if interpret:
        acc, top, total = jax.pure_callback(
            functools.partial(_interpreted, scale=float(scale), meta=meta), shapes, q, k_pages,
            v_pages, table, lengths)
    else:
        import jax_triton

        from tidejax.pallas.gqa_decode_kernel import gqa_decode_kernel

        acc, top, total = jax_triton.triton_call(
            q, k_pages, v_pages, table, lengths, n_table, float(scale), kernel=gqa_decode_kernel,
            out_shape=shapes, grid=(b, g, splits), num_warps=NUM_WARPS, num_stages=2, **meta)
    # the splits by log-sum-exp: [b, g, S, r, ...] -> [b, g, r, ...]
    best = jnp.max(top, axis=2, keepdims=True)
    weight = jnp.exp(top - best)  # 1 for every split of a row with no keys (their sums are 0)
    total = jnp.sum(total * weight, axis=2)
    out = jnp.sum(acc * weight[..., None], axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
    return out.reshape(b, h, dv)
