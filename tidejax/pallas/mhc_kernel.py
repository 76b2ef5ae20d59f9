"""The front half of an mHC site in two Triton kernels (tidejax.pallas.mhc calls them through
jax-triton, or through Triton's interpreter off the GPU). Imported on use only: it needs `triton`.

XLA runs a site as many small launches (the RMS factor, the projection, the sigmoids, Sinkhorn's
loop or kernel, the collapse), 80 sites a V4.1 step. Here:

- mhc_project_kernel: program (token block, split) dots BT tokens' flattened streams [BT, K]
  with fn [O, K] over its split's STEPS blocks of BK columns, float32 IEEE (the reference's
  HIGHEST), and sums their squares for the RMS factor in the same pass: partial sums
  [splits, n, O_P] and [splits, n]. Split-K so that a decode step's one token still spreads the
  read of fn (O x K float32, 1.5 MiB at V4.1's shapes) over many programs.
- mhc_finish_kernel: program (token block, column block) sums its tokens' partials (SB splits a
  load, not one a loop iteration: a decode step has ~100 splits), scales them
  by the RMS factor, takes pre and post (sigmoids) and comb (sinkhorn_block, in registers), and
  collapses its BD columns of the streams by pre (or by a given pre: V4.1 collapses by the last
  site's). Every column block recomputes its tokens' mixes (a few hundred floats a token); the
  first stores them.
"""

import triton
import triton.language as tl

from tidejax.pallas.sinkhorn_kernel import add, sinkhorn_block


@triton.jit
def mhc_project_kernel(x_ptr, fn_ptr, n, part_ptr, sq_ptr, K: tl.constexpr, O: tl.constexpr,
                       O_P: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       STEPS: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)  # [BT]
    split = tl.program_id(1)
    outs = tl.arange(0, O_P)[None, :]  # [1, O_P]
    acc = tl.full((BT, O_P), 0.0, tl.float32)
    sq = tl.full((BT,), 0.0, tl.float32)
    for step in range(STEPS):
        cols = (split * STEPS + step) * BK + tl.arange(0, BK)  # [BK]; past K on the last split
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :],
                    mask=(rows[:, None] < n) & (cols[None, :] < K), other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + outs * K + cols[:, None], mask=(outs < O) & (cols[:, None] < K),
                    other=0.0)  # [BK, O_P]: fn's rows as columns
        acc += tl.dot(x, w, input_precision="ieee")
        sq += tl.reduce(x * x, 1, add)
    tl.store(part_ptr + (split * n + rows[:, None]) * O_P + outs, acc, mask=rows[:, None] < n)
    tl.store(sq_ptr + split * n + rows, sq, mask=rows < n)


@triton.jit
def _sigmoid(z):  # tl.sigmoid is a jitted library function: the interpreter cannot call it
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def mhc_finish_kernel(part_ptr, sq_ptr, base_ptr, scale_ptr, x_ptr, given_ptr, n, splits, eps,
                      hc_eps, pre_ptr, post_ptr, comb_ptr, out_ptr, HC: tl.constexpr,
                      HC_P: tl.constexpr, D: tl.constexpr, O_P: tl.constexpr,
                      ITERS: tl.constexpr, BLOCK: tl.constexpr, BD: tl.constexpr,
                      SB: tl.constexpr, GIVEN: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)[:, None, None]  # [BLOCK, 1, 1]
    j = tl.arange(0, HC_P)[None, :, None]
    k = tl.arange(0, HC_P)[None, None, :]
    live = rows < n
    stream = j < HC  # not padding
    entry = stream & (k < HC)
    m_pre = tl.full((BLOCK, HC_P, 1), 0.0, tl.float32)
    m_post = tl.full((BLOCK, HC_P, 1), 0.0, tl.float32)
    m_comb = tl.full((BLOCK, HC_P, HC_P), 0.0, tl.float32)
    squares = tl.full((BLOCK, 1, 1), 0.0, tl.float32)
    for first in range(0, splits, SB):  # SB splits' partials a load: [BLOCK, SB, ...]
        s = first + tl.arange(0, SB)[None, :, None, None]
        at = (rows[:, None] < n) & (s < splits)
        part = part_ptr + (s * n + rows[:, None]) * O_P
        m_pre += tl.reduce(tl.load(part + j[:, None], mask=at & stream[:, None], other=0.0),
                           1, add)
        m_post += tl.reduce(tl.load(part + HC + j[:, None], mask=at & stream[:, None],
                                    other=0.0), 1, add)
        m_comb += tl.reduce(tl.load(part + 2 * HC + j[:, None] * HC + k[:, None],
                                    mask=at & entry[:, None], other=0.0), 1, add)
        squares += tl.reduce(tl.load(sq_ptr + s * n + rows[:, None], mask=at, other=0.0), 1, add)
    rms = tl.rsqrt(squares / (HC * D) + eps)
    pre = _sigmoid(m_pre * rms * tl.load(scale_ptr)
                   + tl.load(base_ptr + j, mask=stream, other=0.0)) + hc_eps
    post = 2 * _sigmoid(m_post * rms * tl.load(scale_ptr + 1)
                        + tl.load(base_ptr + HC + j, mask=stream, other=0.0))
    logits = (m_comb * rms * tl.load(scale_ptr + 2)
              + tl.load(base_ptr + 2 * HC + j * HC + k, mask=entry, other=0.0))
    comb = sinkhorn_block(logits, entry, hc_eps, ITERS, HC != HC_P)
    stored = rows < tl.where(tl.program_id(1) == 0, n, 0)  # the first column block's
    tl.store(pre_ptr + rows * HC + j, pre, mask=stored & stream)
    tl.store(post_ptr + rows * HC + j, post, mask=stored & stream)
    tl.store(comb_ptr + rows * (HC * HC) + j * HC + k, comb, mask=stored & entry)

    if GIVEN:
        pre = tl.load(given_ptr + rows * HC + j, mask=live & stream, other=0.0)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)[None, None, :]
    x = tl.load(x_ptr + rows * (HC * D) + j * D + cols, mask=live & stream & (cols < D),
                other=0.0).to(tl.float32)
    out = tl.reduce(pre * x, 1, add)  # [BLOCK, BD]
    out_rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)[:, None]
    out_cols = tl.program_id(1) * BD + tl.arange(0, BD)[None, :]
    tl.store(out_ptr + out_rows * D + out_cols, out.to(out_ptr.dtype.element_ty),
             mask=(out_rows < n) & (out_cols < D))
