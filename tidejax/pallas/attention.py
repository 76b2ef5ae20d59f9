"""Paged decode attention over DeepSeek MLA's latent cache (one query a sequence, absorbed W_uk).

For sequence i and head j, over the visible positions p < lengths[i] of its pages:
    scores[p] = (q_latent[i, j] . latent[p] + q_rope[i, j] . rope[p]) * scale    (float32)
    out[i, j] = softmax(scores) @ latent                                          (float32)
where position p lives in page block_table[i, p // page_size] at row p % page_size.

`paged_mla_decode` dispatches between the Pallas GPU kernel (Triton lowering; interpret mode off
the GPU) and `paged_mla_decode_reference` (jnp, float32, runs everywhere).

The kernel, flash-decoding style: program (head block, split, sequence) takes bh heads of one
sequence and walks its positions in chunks of `bs` (a page, part of one, or several small pages), from
its split's share of the ceil(length / bs) chunks the sequence holds (a dynamic loop bound: the
cost follows the length, not the table's width), keeping a running max and sum. Each chunk's
rows are gathered through the block table, read once and used twice: keys for the scores, values
for the output. The splits' partial sums are combined by log-sum-exp in jnp.
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

from tidejax.pallas.dispatch import choose_impl

HIGHEST = jax.lax.Precision.HIGHEST
POOL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _check_args(q_latent, q_rope, latent_pages, rope_pages, block_table, lengths):
    b, h, c = q_latent.shape
    n, ps, _ = latent_pages.shape
    r = q_rope.shape[-1]
    want = {"q_rope": (q_rope.shape, (b, h, r)), "latent_pages": (latent_pages.shape, (n, ps, c)),
            "rope_pages": (rope_pages.shape, (n, ps, r)), "lengths": (lengths.shape, (b,))}
    for name, (got, expected) in want.items():
        if tuple(got) != expected:
            raise ValueError(f"paged_mla_decode: {name} has shape {tuple(got)}, expected {expected} "
                             f"(q_latent {tuple(q_latent.shape)}, latent_pages {tuple(latent_pages.shape)})")
    if block_table.ndim != 2 or block_table.shape[0] != b:
        raise ValueError(f"paged_mla_decode: block_table has shape {tuple(block_table.shape)}, expected [{b}, P]")
    if latent_pages.dtype != rope_pages.dtype:
        raise ValueError(f"paged_mla_decode: latent_pages {latent_pages.dtype} and rope_pages "
                         f"{rope_pages.dtype} must share a dtype")


def paged_mla_decode_reference(q_latent, q_rope, latent_pages, rope_pages, block_table, lengths, *,
                               scale):
    """q_latent [b, h, c], q_rope [b, h, r], latent_pages [n_pages, page_size, c], rope_pages
    [n_pages, page_size, r], block_table [b, P] int32, lengths [b] int32 -> out [b, h, c] float32.

    Gathers the P pages of each sequence ([b, P * page_size, c]: the cost follows P, not the
    pool), then float32 throughout (HIGHEST precision dots). Rows of length 0 give zeros.
    """
    _check_args(q_latent, q_rope, latent_pages, rope_pages, block_table, lengths)
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


def _decode_kernel(table_ref, lengths_ref, *refs, bh, bs, ps, n_table, splits, scale, two_terms):
    """Refs: table [b, P], lengths [b], q terms [b, hp, c] (1 or 2), q_rope terms [b, hp, r],
    latent [n_pages * ps, c], rope [n_pages * ps, r] -> acc [b, S, hp, c], top [b, S, hp],
    total [b, S, hp] (float32: the split's unnormalized output, running max and sum)."""
    terms = 2 if two_terms else 1
    q_refs, qr_refs = refs[:terms], refs[terms:2 * terms]
    latent_ref, rope_ref, acc_ref, top_ref, total_ref = refs[2 * terms:]
    hb, split, seq = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads = pl.ds(hb * bh, bh)
    c, r = latent_ref.shape[1], rope_ref.shape[1]
    page_bits = ps.bit_length() - 1
    length = jnp.clip(lengths_ref[seq], 0, n_table * ps)
    n_chunks = (length + bs - 1) // bs
    per_split = jnp.maximum((n_chunks + splits - 1) // splits, MIN_CHUNKS_PER_SPLIT)
    first = jnp.minimum(split * per_split, n_chunks)
    last = jnp.minimum(first + per_split, n_chunks)
    qs = [ref[seq, heads, pl.ds(0, c)] for ref in q_refs]  # [bh, c] each
    qrs = [ref[seq, heads, pl.ds(0, r)] for ref in qr_refs]  # [bh, r] each

    def chunk(j, carry):
        top, total, acc = carry
        pos = j * bs + jnp.arange(bs, dtype=jnp.int32)  # [bs]
        if bs <= ps:  # the chunk lies in one page: a block of contiguous rows
            page = table_ref[seq, (j * bs) >> page_bits]
            rows = pl.ds(pl.multiple_of((page << page_bits) + ((j * bs) & (ps - 1)), bs), bs)
        else:  # several pages a chunk: rows gathered one by one
            pages = table_ref[seq, jnp.minimum(pos >> page_bits, n_table - 1)]
            rows = (pages << page_bits) | (pos & (ps - 1))  # ps a power of two
        latent = latent_ref[rows, pl.ds(0, c)]  # [bs, c]
        rope = rope_ref[rows, pl.ds(0, r)]  # [bs, r]
        s = sum(_dot_t(q, latent) for q in qs) + sum(_dot_t(q, rope) for q in qrs)  # [bh, bs]
        s = jnp.where((pos < length)[None, :], s * scale, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(s, axis=1))  # finite: the chunk holds a visible row
        keep = jnp.exp(top - new_top)
        p = jnp.exp(s - new_top[:, None])
        pv = jax.lax.dot_general(p.astype(latent.dtype), latent, (((1,), (0,)), ((), ())),
                                 precision=HIGHEST, preferred_element_type=jnp.float32)
        return new_top, total * keep + jnp.sum(p, axis=1), acc * keep[:, None] + pv

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

    _check_args(q_latent, q_rope, latent_pages, rope_pages, block_table, lengths)
    if not pallas_supports(q_latent, q_rope, latent_pages):
        raise ValueError(f"paged_mla_decode(impl='pallas'): shapes the kernel does not take: q_latent "
                         f"{q_latent.shape} {q_latent.dtype}, q_rope {q_rope.shape}, latent_pages "
                         f"{latent_pages.shape} {latent_pages.dtype}")
    b, h, c = q_latent.shape
    n, ps, r = rope_pages.shape
    n_table = block_table.shape[1]
    bh, bs, num_warps, num_stages = tile or TILE
    bh = min(bh, max(16, 1 << (h - 1).bit_length()))  # no more heads a block than the model has
    hp = -(-h // bh) * bh
    max_chunks = -(-n_table * ps // bs)
    splits = splits or choose_splits(b, hp // bh, max_chunks)

    dtype = latent_pages.dtype
    pad = lambda q: jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))  # [b, hp, *]
    two_terms = dtype == jnp.bfloat16 and jnp.float32 in (q_latent.dtype, q_rope.dtype)
    if two_terms:
        split = lambda q: (q.astype(dtype), (q.astype(jnp.float32) - q.astype(dtype)).astype(dtype))
        qs, qrs = split(pad(q_latent)), split(pad(q_rope))
    else:
        qs, qrs = (pad(q_latent).astype(dtype),), (pad(q_rope).astype(dtype),)

    f32 = jnp.float32
    acc, top, total = pl.pallas_call(
        functools.partial(_decode_kernel, bh=bh, bs=bs, ps=ps, n_table=n_table, splits=splits,
                          scale=float(scale), two_terms=two_terms),
        out_shape=(jax.ShapeDtypeStruct((b, splits, hp, c), f32), jax.ShapeDtypeStruct((b, splits, hp), f32),
                   jax.ShapeDtypeStruct((b, splits, hp), f32)),
        grid=(hp // bh, splits, b),  # head blocks fastest: the programs reading a page run together
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_mla_decode",
    )(block_table.astype(jnp.int32), lengths.astype(jnp.int32), *qs, *qrs,
      latent_pages.reshape(n * ps, c), rope_pages.reshape(n * ps, r))
    return _combine(acc, top, total)[:, :h]


def paged_mla_decode(q_latent, q_rope, latent_pages, rope_pages, block_table, lengths, *, scale,
                     impl: str = "auto"):
    """Decode attention of one layer over its paged latent cache (shapes: see
    `paged_mla_decode_reference`) -> out [b, h, c] float32.

    impl: "auto" (the Pallas kernel on a GPU when it takes the shapes, `pallas_supports`; the
    reference elsewhere) | "pallas" (interpret mode off the GPU) | "reference". The kernel
    against the float32 reference: ~1e-7 for float32 pools; bf16 pools ~1e-3 (probabilities
    rounded to bf16 for the value dot). H200, V3 shapes: 3.5-5x faster than the jitted reference.
    """
    impl = choose_impl("paged_mla_decode", impl,
                       fits=lambda: pallas_supports(q_latent, q_rope, latent_pages))
    with jax.named_scope(f"paged_mla_decode_{impl}"):
        if impl == "reference":
            return paged_mla_decode_reference(q_latent, q_rope, latent_pages, rope_pages, block_table,
                                              lengths, scale=scale)
        return paged_mla_decode_pallas(q_latent, q_rope, latent_pages, rope_pages, block_table, lengths,
                                       scale=float(scale), interpret=jax.default_backend() != "gpu")
