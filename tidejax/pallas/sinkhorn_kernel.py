"""mHC's Sinkhorn as one Triton kernel (tidejax.pallas.sinkhorn calls it through jax-triton, or
through Triton's interpreter off the GPU). Imported on use only: it needs `triton`.

Each program normalizes BLOCK matrices of [HC, HC] held in registers, padded to [HC_P, HC_P] (a
power of two) with zeros that no sum sees: the softmax over k, then ITERS alternating column and
row normalizations, the whole loop in one launch (XLA's form is a while loop of reductions: two
launches and a trip-count check an iteration, 19 iterations a site, 80 sites a V4.1 step).
The matrices lie first ([BLOCK, HC_P, HC_P]). Laid along the last axis instead, so that a thread
might hold whole matrices, a launch took 114 us where this one takes 43 us (a 40-layer V4.1
decode step on an H100, one token: bench/RESULTS.md, 2026-12-06), and a thread a matrix with its
16 entries in registers took 103 us (2026-12-07). Timed alone (80 chained sites, one token),
dividing each entry took 27.5 us a site and multiplying by each sum's reciprocal 13.4 us
(2026-12-07): the kernel takes reciprocals.
"""

import triton
import triton.language as tl


# reductions through tl.reduce with combine functions of our own: tl.sum and tl.max are jitted
# library functions that Triton's interpreter cannot call unless the process started in its
# interpreter mode (TRITON_INTERPRET=1), which would take the GPU path from everything else
@triton.jit
def add(a, b):
    return a + b


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def sinkhorn_block(x, entry, hc_eps, ITERS: tl.constexpr, PADDED: tl.constexpr):
    """Logits x [BLOCK, HC_P(j), HC_P(k)] in registers, `entry` where they are not padding
    (PADDED: whether there is any) -> the normalized mix, padding 0: the softmax over k, then
    ITERS column and row passes. mHC's fused front (mhc_kernel) calls it too."""
    if PADDED:
        x = tl.where(entry, x, -3.0e38)  # finite: no inf - inf where a padded row's max is taken
    x = x - tl.reduce(x, 2, _larger, keep_dims=True)
    e = tl.exp(x)
    if PADDED:
        e = tl.where(entry, e, 0.0)
    total = tl.reduce(e, 2, add, keep_dims=True)  # >= 1 but in padding rows (j >= HC): 0
    c = e * (1.0 / tl.where(total > 0, total, 1.0)) + hc_eps
    # each normalization: one reciprocal a sum, a product an entry (a division an entry took
    # twice the time); padding kept at 0 (0 / 0 where hc_eps is 0)
    if PADDED:
        c = tl.where(entry, c, 0.0)
    c = c * (1.0 / (tl.reduce(c, 1, add, keep_dims=True) + hc_eps))
    for _ in tl.static_range(ITERS - 1):
        if PADDED:
            c = tl.where(entry, c, 0.0)
        c = c * (1.0 / (tl.reduce(c, 2, add, keep_dims=True) + hc_eps))
        if PADDED:
            c = tl.where(entry, c, 0.0)
        c = c * (1.0 / (tl.reduce(c, 1, add, keep_dims=True) + hc_eps))
    if PADDED:
        c = tl.where(entry, c, 0.0)
    return c


@triton.jit
def sinkhorn_kernel(logits_ptr, n, hc_eps, out_ptr, HC: tl.constexpr, HC_P: tl.constexpr,
                    ITERS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)[:, None, None]  # [BLOCK, 1, 1]
    j = tl.arange(0, HC_P)[None, :, None]
    k = tl.arange(0, HC_P)[None, None, :]
    entry = (j < HC) & (k < HC)  # not padding; rows past n compute on zeros, stored nowhere
    offsets = rows * (HC * HC) + j * HC + k
    x = tl.load(logits_ptr + offsets, mask=(rows < n) & entry, other=0.0)
    c = sinkhorn_block(x, entry, hc_eps, ITERS, HC != HC_P)
    tl.store(out_ptr + offsets, c, mask=(rows < n) & entry)
