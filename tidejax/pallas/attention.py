"""Paged attention over DeepSeek MLA's latent cache (absorbed W_uk): decode (one query a sequence)
and prefill (a prompt chunk's queries).

For sequence i, head j and a query at position q (decode: q = lengths[i] - 1), over the visible
positions p <= q of its pages:
    scores[p] = (q_latent[i, j] . latent[p] + q_rope[i, j] . rope[p]) * scale    (float32)
    out[i, j] = softmax(scores) @ latent                                          (float32)
where position p lives in page block_table[i, p // page_size] at row p % page_size.

The Pallas GPU kernels (Triton lowering; interpret mode off the GPU) and their jnp references
(run everywhere) keep one contract; tidejax.ops.paged_mla_decode and paged_mla_prefill pick
between them.

The decode kernel, flash-decoding style: program (head block, split, sequence) takes bh heads of
one sequence and walks its positions in chunks of `bs` (a page, part of one, or several small
pages), from its split's share of the ceil(length / bs) chunks the sequence holds (a dynamic loop
bound: the cost follows the length, not the table's width), keeping a running max and sum. Each
chunk's rows are gathered through the block table, read once and used twice: keys for the scores,
values for the output. The splits' partial sums are combined by log-sum-exp in jnp.

The prefill kernel, flash-attention style: program (query block, head block, sequence) stacks
its bq queries x bh heads as the rows of its dots, walks the row's keys a block at a time up to
its last query's position and writes its output once (PREFILL_TILE).

Dots take the pool's dtype with float32 accumulation: bf16 pools run bf16 dots (float32 queries
enter as two bf16 terms, their rounding and the rest, so the scores keep ~16 mantissa bits; the
probabilities enter the value dot rounded to bf16, as in FlashAttention); float32 pools run
float32 dots (IEEE, no TF32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

HIGHEST = jax.lax.Precision.HIGHEST
POOL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _check_args(op, q_latent, q_rope, latent_pages, rope_pages, block_table, index, index_name, *,
                kernel=False):
    """Shapes of one call: queries [*lead, h, c|r] (lead: (b,) for decode, (b, t) for a chunk),
    pages [n_pages, page_size, c|r] of one dtype, block_table [b, P], index (lengths | positions)
    [*lead]; with `kernel`, shapes the Pallas kernels take (`pallas_supports`)."""
    *lead, h, c = q_latent.shape
    n, ps, _ = latent_pages.shape
    r = q_rope.shape[-1]
    want = {"q_rope": (q_rope.shape, (*lead, h, r)), "latent_pages": (latent_pages.shape, (n, ps, c)),
            "rope_pages": (rope_pages.shape, (n, ps, r)), index_name: (index.shape, tuple(lead))}
    for name, (got, expected) in want.items():
        if tuple(got) != expected:
            raise ValueError(f"{op}: {name} has shape {tuple(got)}, expected {expected} "
                             f"(q_latent {tuple(q_latent.shape)}, latent_pages {tuple(latent_pages.shape)})")
    if block_table.ndim != 2 or block_table.shape[0] != lead[0]:
        raise ValueError(f"{op}: block_table has shape {tuple(block_table.shape)}, expected [{lead[0]}, P]")
    if latent_pages.dtype != rope_pages.dtype:
        raise ValueError(f"{op}: latent_pages {latent_pages.dtype} and rope_pages "
                         f"{rope_pages.dtype} must share a dtype")
    if kernel and not pallas_supports(q_latent, q_rope, latent_pages):
        raise ValueError(f"{op}(impl='pallas'): shapes the kernel does not take: q_latent "
                         f"{q_latent.shape} {q_latent.dtype}, q_rope {q_rope.shape}, latent_pages "
                         f"{latent_pages.shape} {latent_pages.dtype}")


def paged_mla_decode_reference(q_latent, q_rope, latent_pages, rope_pages, block_table, lengths, *,
                               scale):
    """q_latent [b, h, c], q_rope [b, h, r], latent_pages [n_pages, page_size, c], rope_pages
    [n_pages, page_size, r], block_table [b, P] int32, lengths [b] int32 -> out [b, h, c] float32.

    Gathers the P pages of each sequence ([b, P * page_size, c]: the cost follows P, not the
    pool), then float32 throughout (HIGHEST precision dots). Rows of length 0 give zeros.
    """
    _check_args("paged_mla_decode", q_latent, q_rope, latent_pages, rope_pages, block_table, lengths,
                "lengths")
    b, n_table = block_table.shape
    _, ps, c = latent_pages.shape
    r = rope_pages.shape[-1]
    f32 = jnp.float32
    latent = latent_pages[block_table].reshape(b, n_table * ps, c).astype(f32)  # [b, s, c]
    rope = rope_pages[block_table].reshape(b, n_table * ps, r).astype(f32)  # [b, s, r]
    scores = (jnp.einsum("bhc,bsc->bhs", q_latent.astype(f32), latent, precision=HIGHEST)
              + jnp.einsum("bhr,bsr->bhs", q_rope.astype(f32), rope, precision=HIGHEST)) * scale
    visible = jnp.arange(n_table * ps)[None, None, :] < lengths[:, None, None]  # [b, 1, s]
    scores = jnp.where(visible, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))  # 0 where not visible
    total = jnp.sum(probs, axis=-1, keepdims=True)  # [b, h, 1]
    out = jnp.einsum("bhs,bsc->bhc", probs, latent, precision=HIGHEST)
    return jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)


# ---- the kernel ---------------------------------------------------------------------------------

# (heads a program bh, positions a chunk bs, num_warps, num_stages): a chunk is a block of rows
# of one page (bs <= page_size) or several pages gathered row by row (as fast, on the H200).
# H200 sweep at DeepSeek-V3 shapes (h 128, c 512, r 64, pages of 64; jax 0.11.2): this tile is the
# best or within 4% at b 1 / 4 and 4K contexts and b 1 at 32K (80 us); at b 4 and 32K (64, 32, 8, 2)
# is 18% faster (271 us against 330). num_stages 1 is ~2x slower; bs 32 or 16 slower. At 128 heads
# a position costs ~240 FLOP a byte: the kernel is bound by its bf16 dots (~110-135 TFLOP/s,
# 0.12-0.15 of the HBM read ceiling), not by the bytes.
TILE = (16, 64, 4, 2)
# Programs the grid aims at (two waves of the H200's 132 multiprocessors) and the fewest chunks a
# split takes: a split writes [bh, c] float32 partials, as many bytes as ~3.5 pages of V3's latent.
TARGET_PROGRAMS = 264
MIN_CHUNKS_PER_SPLIT = 4


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def pallas_supports(q_latent, q_rope, latent_pages) -> bool:
    """Whether the kernel takes these shapes: c and r powers of two >= 16 (Triton blocks and dot
    widths), page_size a power of two, bf16 or float32 pools and queries."""
    c, r, ps = q_latent.shape[-1], q_rope.shape[-1], latent_pages.shape[1]
    dtypes = {jnp.dtype(a.dtype) for a in (q_latent, q_rope, latent_pages)}
    return _pow2(c) and _pow2(r) and min(c, r) >= 16 and _pow2(ps) and dtypes <= set(POOL_DTYPES)


def choose_splits(b: int, head_blocks: int, max_chunks: int) -> int:
    """Splits of each sequence's chunks (static): enough programs to fill the GPU, none that
    could not get MIN_CHUNKS_PER_SPLIT chunks of a full table."""
    want = -(-TARGET_PROGRAMS // (b * head_blocks))
    return max(1, min(want, max_chunks // MIN_CHUNKS_PER_SPLIT))


def _dot_t(a, b):
    """a [m, k] @ b [n, k].T, float32 accumulation (IEEE for float32 operands)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HIGHEST,
                               preferred_element_type=jnp.float32)


def dot_terms(q, dtype) -> tuple:
    """A query as dot operands of the pool's dtype: one term, or for a float32 query over a bf16
    pool two bf16 terms (its rounding and the rest: ~16 mantissa bits kept). The rounding is a
    reduce_precision: XLA:GPU drops a float32 -> bf16 -> float32 round trip (excess precision is
    allowed there), which would leave the rest zero."""
    if dtype == jnp.bfloat16 and q.dtype == jnp.float32:
        high = jax.lax.reduce_precision(q, exponent_bits=8, mantissa_bits=7)  # exact in bf16
        return high.astype(dtype), (q - high).astype(dtype)
    return (q.astype(dtype),)


def _query_terms(q_latent, q_rope, dtype):
    """Queries as dot operands of the pool's dtype -> (q_latent terms, q_rope terms): one term
    each, or where either query is float32 over a bf16 pool two bf16 terms each."""
    if dtype == jnp.bfloat16 and jnp.float32 in (q_latent.dtype, q_rope.dtype):
        f32 = jnp.float32
        return dot_terms(q_latent.astype(f32), dtype), dot_terms(q_rope.astype(f32), dtype)
    return (q_latent.astype(dtype),), (q_rope.astype(dtype),)


def _key_rows(table_ref, seq, start, bs, ps, n_table):
    """Positions start..start+bs of row `seq` -> (positions [bs], their pool rows): a block of
    contiguous rows when they lie in one page (bs <= page_size, start a multiple of bs), else
    rows gathered one by one (page indices past the table clamped to its last page)."""
    page_bits = ps.bit_length() - 1
    pos = start + jnp.arange(bs, dtype=jnp.int32)  # [bs]
    if bs <= ps:
        page = table_ref[seq, start >> page_bits]
        return pos, pl.ds(pl.multiple_of((page << page_bits) + (start & (ps - 1)), bs), bs)
    pages = table_ref[seq, jnp.minimum(pos >> page_bits, n_table - 1)]
    return pos, (pages << page_bits) | (pos & (ps - 1))  # ps a power of two


def _attend(qs, qrs, latent, rope, visible, carry, scale):
    """One block of keys for m query rows: query terms qs [m, c], qrs [m, r] against latent
    [bs, c], rope [bs, r] where visible [m | 1, bs]; carry (running max [m], sum [m], output
    [m, c], float32) -> the carry updated. A row's max must be finite after the block or start
    finite (a large negative number), so that rows with nothing visible keep a zero sum."""
    top, total, acc = carry
    s = sum(_dot_t(q, latent) for q in qs) + sum(_dot_t(q, rope) for q in qrs)  # [m, bs]
    s = jnp.where(visible, s * scale, -jnp.inf)
    new_top = jnp.maximum(top, jnp.max(s, axis=1))
    keep = jnp.exp(top - new_top)
    p = jnp.exp(s - new_top[:, None])
    pv = jax.lax.dot_general(p.astype(latent.dtype), latent, (((1,), (0,)), ((), ())),
                             precision=HIGHEST, preferred_element_type=jnp.float32)
    return new_top, total * keep + jnp.sum(p, axis=1), acc * keep[:, None] + pv


def _decode_kernel(table_ref, lengths_ref, *refs, bh, bs, ps, n_table, splits, scale, terms):
    """Refs: table [b, P], lengths [b], q terms [b, hp, c] (1 or 2), q_rope terms [b, hp, r],
    latent [n_pages * ps, c], rope [n_pages * ps, r] -> acc [b, S, hp, c], top [b, S, hp],
    total [b, S, hp] (float32: the split's unnormalized output, running max and sum)."""
    q_refs, qr_refs = refs[:terms], refs[terms:2 * terms]
    latent_ref, rope_ref, acc_ref, top_ref, total_ref = refs[2 * terms:]
    hb, split, seq = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads = pl.ds(hb * bh, bh)
    c, r = latent_ref.shape[1], rope_ref.shape[1]
    length = jnp.clip(lengths_ref[seq], 0, n_table * ps)
    n_chunks = (length + bs - 1) // bs
    per_split = jnp.maximum((n_chunks + splits - 1) // splits, MIN_CHUNKS_PER_SPLIT)
    first = jnp.minimum(split * per_split, n_chunks)
    last = jnp.minimum(first + per_split, n_chunks)
    qs = [ref[seq, heads, pl.ds(0, c)] for ref in q_refs]  # [bh, c] each
    qrs = [ref[seq, heads, pl.ds(0, r)] for ref in qr_refs]  # [bh, r] each

    def chunk(j, carry):  # each chunk holds a visible position: the running max stays finite
        pos, rows = _key_rows(table_ref, seq, j * bs, bs, ps, n_table)
        latent = latent_ref[rows, pl.ds(0, c)]  # [bs, c]
        rope = rope_ref[rows, pl.ds(0, r)]  # [bs, r]
        return _attend(qs, qrs, latent, rope, (pos < length)[None, :], carry, scale)

    init = (jnp.full((bh,), -jnp.inf, jnp.float32), jnp.zeros((bh,), jnp.float32),
            jnp.zeros((bh, c), jnp.float32))
    top, total, acc = jax.lax.fori_loop(first, last, chunk, init)
    top_ref[seq, split, heads] = top
    total_ref[seq, split, heads] = total

    @pl.when(last > first)  # an empty split's acc stays unwritten: the combine skips it
    def _():
        acc_ref[seq, split, heads, pl.ds(0, c)] = acc


def _combine(acc, top, total):
    """Partials of the splits (acc [b, S, hp, c], top / total [b, S, hp]) -> [b, hp, c]."""
    live = total > 0
    best = jnp.max(jnp.where(live, top, -jnp.inf), axis=1, keepdims=True)  # [b, 1, hp]
    weight = jnp.where(live, jnp.exp(top - jnp.where(jnp.isfinite(best), best, 0.0)), 0.0)
    num = jnp.sum(jnp.where(live[..., None], acc, 0.0) * weight[..., None], axis=1)
    den = jnp.sum(weight * total, axis=1)[..., None]
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "tile", "splits"))
def paged_mla_decode_pallas(q_latent, q_rope, latent_pages, rope_pages, block_table, lengths, *,
                            scale: float, interpret: bool = False, tile=None, splits=None):
    """Same contract as `paged_mla_decode_reference`; scale a Python float.

    tile: (bh, bs, num_warps, num_stages) to override TILE; splits: to override `choose_splits`
    (benchmarks)."""
    from jax.experimental.pallas import triton as plgpu  # here: the Triton lowering loads on use

    from tidejax.pallas import triton_offsets  # noqa: F401  (64-bit offsets for 2**31+ element refs)

    _check_args("paged_mla_decode", q_latent, q_rope, latent_pages, rope_pages, block_table, lengths,
                "lengths", kernel=True)
    b, h, c = q_latent.shape
    n, ps, r = rope_pages.shape
    n_table = block_table.shape[1]
    bh, bs, num_warps, num_stages = tile or TILE
    bh = min(bh, max(16, 1 << (h - 1).bit_length()))  # no more heads a block than the model has
    hp = -(-h // bh) * bh
    max_chunks = -(-n_table * ps // bs)
    splits = splits or choose_splits(b, hp // bh, max_chunks)

    pad = lambda q: jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))  # [b, hp, *]
    qs, qrs = _query_terms(pad(q_latent), pad(q_rope), latent_pages.dtype)

    f32 = jnp.float32
    acc, top, total = pl.pallas_call(
        functools.partial(_decode_kernel, bh=bh, bs=bs, ps=ps, n_table=n_table, splits=splits,
                          scale=float(scale), terms=len(qs)),
        out_shape=(jax.ShapeDtypeStruct((b, splits, hp, c), f32), jax.ShapeDtypeStruct((b, splits, hp), f32),
                   jax.ShapeDtypeStruct((b, splits, hp), f32)),
        grid=(hp // bh, splits, b),  # head blocks fastest: the programs reading a page run together
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_mla_decode",
    )(block_table.astype(jnp.int32), lengths.astype(jnp.int32), *qs, *qrs,
      latent_pages.reshape(n * ps, c), rope_pages.reshape(n * ps, r))
    return _combine(acc, top, total)[:, :h]


# ---- prefill: a prompt chunk's queries over their rows' pages ------------------------------------

QUERY_BLOCK = 256  # queries the reference attends at once: bounds its [b, h, queries, keys] scores
KEY_BLOCK = 512  # keys the reference attends a loop step (whole pages; at least one page)


def paged_mla_prefill_reference(q_latent, q_rope, latent_pages, rope_pages, block_table, positions, *,
                                scale):
    """q_latent [b, t, h, c], q_rope [b, t, h, r], latent_pages [n_pages, page_size, c], rope_pages
    [n_pages, page_size, r], block_table [b, P] int32, positions [b, t] int32 -> out [b, t, h, c]
    in the queries' dtype: query (i, j) attends the positions p <= positions[i, j] of row i's
    pages (all P pages for a position past them; zeros for a negative one).

    Flash attention in jnp: a long chunk goes QUERY_BLOCK queries at a time (lax.map), each over
    KEY_BLOCK keys at a time gathered page by page from the table, with a running max and sum; the
    loop stops at the block holding the chunk's last position, so a chunk costs the keys it can
    see, not the table's width (differentiable where the chunk is as long as its table: the bound
    is then static). Dots in the operands' dtypes with float32 accumulation (HIGHEST);
    probabilities enter the value dot in the pool's dtype."""
    _check_args("paged_mla_prefill", q_latent, q_rope, latent_pages, rope_pages, block_table, positions,
                "positions")
    latent_pages, rope_pages = jnp.asarray(latent_pages), jnp.asarray(rope_pages)  # indexed by tracers
    t = q_latent.shape[1]
    if t <= QUERY_BLOCK or t % QUERY_BLOCK:
        return _chunk_reference(q_latent, q_rope, latent_pages, rope_pages, block_table, positions, scale)
    blocks = t // QUERY_BLOCK

    def split(x):  # [b, t, ...] -> [blocks, b, QUERY_BLOCK, ...]
        return jnp.moveaxis(x.reshape(x.shape[0], blocks, QUERY_BLOCK, *x.shape[2:]), 1, 0)
    out = jax.lax.map(
        lambda q: _chunk_reference(*q[:2], latent_pages, rope_pages, block_table, q[2], scale),
        (split(q_latent), split(q_rope), split(positions)))
    return jnp.moveaxis(out, 0, 1).reshape(q_latent.shape)


def _einsum_f32(spec, a, b):
    """einsum with float32 accumulation (HIGHEST). XLA:CPU has no bf16 x bf16 -> float32 dot, so
    off the GPU the operands enter as float32: the same products (exact in float32) and sums."""
    if jax.default_backend() != "gpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(spec, a, b, precision=HIGHEST, preferred_element_type=jnp.float32)


def _chunk_reference(q_latent, q_rope, latent_pages, rope_pages, block_table, positions, scale):
    """`paged_mla_prefill_reference` for one block of queries (all of them at once)."""
    n_pages, page_size, c = latent_pages.shape
    r = rope_pages.shape[-1]
    per_block = max(1, KEY_BLOCK // page_size)  # pages a key block holds
    keys = per_block * page_size
    b, t, h, _ = q_latent.shape
    width = block_table.shape[1]
    table = jnp.pad(block_table, ((0, 0), (0, -width % per_block)))  # padding: page 0, masked
    n_blocks = table.shape[1] // per_block
    if width * page_size > t:  # key blocks up to the last query's position (a dynamic bound)
        n_blocks = jnp.clip((jnp.max(positions) + keys) // keys, 0, n_blocks)
    # else the chunk is as long as its table (a full forward: scoring, training): every block,
    # a static bound, which reverse-mode differentiation needs
    last = width * page_size - 1  # a position past the table sees all of it

    def attend_block(i, carry):
        top, total, acc = carry  # [b, h, t], [b, h, t], [b, t, h, c]
        pages = jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block, axis=1)
        latent = latent_pages[pages].reshape(b, keys, c)  # [b, keys, c]
        rope = rope_pages[pages].reshape(b, keys, r)  # [b, keys, r]
        scores = (_einsum_f32("bthc,bsc->bhts", q_latent, latent)
                  + _einsum_f32("bthr,bsr->bhts", q_rope, rope)) * scale
        key_pos = i * keys + jnp.arange(keys)[None, None, :]
        visible = key_pos <= jnp.minimum(positions, last)[:, :, None]  # [b, t, s]
        scores = jnp.where(visible[:, None], scores, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
        probs = jnp.exp(scores - new_top[..., None])
        keep = jnp.exp(top - new_top)
        total = total * keep + jnp.sum(probs, axis=-1)
        acc = acc * jnp.moveaxis(keep, 1, 2)[..., None] + _einsum_f32(
            "bhts,bsc->bthc", probs.astype(latent.dtype), latent)
        return new_top, total, acc

    start = (jnp.full((b, h, t), -1e30, jnp.float32), jnp.zeros((b, h, t), jnp.float32),
             jnp.zeros((b, t, h, c), jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, n_blocks, attend_block, start)
    total = jnp.moveaxis(total, 1, 2)[..., None]  # [b, t, h, 1]
    return (acc / jnp.where(total > 0, total, 1.0)).astype(q_latent.dtype)


# (queries a program bq, heads a program bh, keys a block bk, num_warps, num_stages): a program
# stacks its bq x bh (query, head) pairs as the M = bq * bh rows of its dots, so each key block it
# loads serves them all; its loop runs bk keys at a time up to the block of its last query's
# position (causal skipping). The float32 output [M, c] lives in registers (M 32, c 512: 128 a
# thread at 4 warps), the queries [M, c + r] and num_stages key blocks [bk, c + r] in shared memory.
# All powers of two. H200 sweep at V3 shapes (h 128, c 512, r 64, bf16 pages of 64, jax 0.11.2,
# bench/prefill_attention.py): 2048 queries at 6144..8191 take 15.6 ms a layer (262 TFLOP/s of
# causal work, 0.38 of the bf16 matmul rate; the jnp reference 32.3 ms), 512 at 0..511 0.37 ms
# (the reference 0.99). num_stages 3 the same; M 64 (4x16 or 1x64 at 8 warps) 22 ms, 8 warps at
# M 32 27 ms, bk 32 or 128 20 / 18 ms, num_stages 1 34 ms, M 16 21 ms.
PREFILL_TILE = (2, 16, 64, 4, 2)


def _prefill_kernel(table_ref, pos_ref, *refs, bq, bh, bk, ps, n_table, scale, terms):
    """Refs: table [b, P], positions [b, tp] (clipped to the table), q terms [b, tp, hp, c] (1 or
    2), q_rope terms [b, tp, hp, r], latent [n_pages * ps, c], rope [n_pages * ps, r] -> out [b, tp,
    hp, c]. Program (query block, head block, sequence)."""
    q_refs, qr_refs = refs[:terms], refs[terms:2 * terms]
    latent_ref, rope_ref, out_ref = refs[2 * terms:]
    qb = pl.num_programs(0) - 1 - pl.program_id(0)  # the latest queries (the longest loops) first
    hb, seq = pl.program_id(1), pl.program_id(2)
    m = bq * bh  # rows: query i's heads are rows i * bh .. i * bh + bh - 1
    queries, heads = pl.ds(qb * bq, bq), pl.ds(hb * bh, bh)
    c, r = latent_ref.shape[1], rope_ref.shape[1]
    row_pos = pos_ref[seq, qb * bq + jnp.arange(m, dtype=jnp.int32) // bh]  # [m]
    n_blocks = (jnp.max(row_pos) + bk) // bk  # up to the block of the last position (<= 0: none)
    qs = [ref[seq, queries, heads, pl.ds(0, c)].reshape(m, c) for ref in q_refs]
    qrs = [ref[seq, queries, heads, pl.ds(0, r)].reshape(m, r) for ref in qr_refs]

    def block(j, carry):
        pos, rows = _key_rows(table_ref, seq, j * bk, bk, ps, n_table)
        latent = latent_ref[rows, pl.ds(0, c)]  # [bk, c]: keys, then values
        rope = rope_ref[rows, pl.ds(0, r)]  # [bk, r]
        return _attend(qs, qrs, latent, rope, pos[None, :] <= row_pos[:, None], carry, scale)

    init = (jnp.full((m,), -1e30, jnp.float32), jnp.zeros((m,), jnp.float32),
            jnp.zeros((m, c), jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, n_blocks, block, init)
    out = acc / jnp.where(total > 0, total, 1.0)[:, None]  # rows that see nothing: zeros
    out_ref[seq, queries, heads, pl.ds(0, c)] = out.astype(out_ref.dtype).reshape(bq, bh, c)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "tile"))
def paged_mla_prefill_pallas(q_latent, q_rope, latent_pages, rope_pages, block_table, positions, *,
                             scale: float, interpret: bool = False, tile=None):
    """Same contract as `paged_mla_prefill_reference`; scale a Python float; tile (bq, bh, bk,
    num_warps, num_stages) to override PREFILL_TILE (benchmarks). Fewer heads than bh: the rows
    go to more queries a program (bq * bh kept)."""
    from jax.experimental.pallas import triton as plgpu  # here: the Triton lowering loads on use

    from tidejax.pallas import triton_offsets  # noqa: F401  (64-bit offsets for 2**31+ element refs)

    _check_args("paged_mla_prefill", q_latent, q_rope, latent_pages, rope_pages, block_table, positions,
                "positions", kernel=True)
    bq, bh, bk, num_warps, num_stages = tile or PREFILL_TILE
    if not all(_pow2(x) for x in (bq, bh, bk)):
        raise ValueError(f"paged_mla_prefill: tile {tile}: bq, bh and bk must be powers of two")
    b, t, h, c = q_latent.shape
    n, ps, r = rope_pages.shape
    n_table = block_table.shape[1]
    fit = min(bh, _pow2_at_least(h))
    bq, bh = bq * (bh // fit), fit
    tp, hp = -(-t // bq) * bq, -(-h // bh) * bh
    pad = lambda q: jnp.pad(q, ((0, 0), (0, tp - t), (0, hp - h), (0, 0)))  # [b, tp, hp, *]
    qs, qrs = _query_terms(pad(q_latent), pad(q_rope), latent_pages.dtype)
    # padded queries repeat the last one; a position past the table sees all of it
    pos = jnp.minimum(jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, tp - t)), mode="edge"),
                      n_table * ps - 1)
    out = pl.pallas_call(
        functools.partial(_prefill_kernel, bq=bq, bh=bh, bk=bk, ps=ps, n_table=n_table,
                          scale=float(scale), terms=len(qs)),
        out_shape=jax.ShapeDtypeStruct((b, tp, hp, c), q_latent.dtype),
        grid=(tp // bq, hp // bh, b),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_mla_prefill",
    )(block_table.astype(jnp.int32), pos, *qs, *qrs, latent_pages.reshape(n * ps, c),
      rope_pages.reshape(n * ps, r))
    return out[:, :t, :h]
