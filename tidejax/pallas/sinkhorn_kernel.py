"""mHC's Sinkhorn as one Triton kernel for hc = 4, the streams every DeepSeek-V4 / V4.1 checkpoint
ships (tidejax.pallas.sinkhorn calls it through jax-triton, or through Triton's interpreter off
the GPU). Imported on use only: it needs `triton`.

A thread holds one matrix, its 16 entries as 16 registers (x{j}{k}: one [BLOCK] vector each, a
matrix a lane), so every row and column sum is three adds in a thread: no reduction crosses
threads and no layout changes. The softmax over k, then ITERS alternating column and row
normalizations, the whole loop in one launch (XLA's form is a while loop of reductions: two
launches and a trip-count check an iteration, 19 iterations a site, 80 sites a V4.1 step).
Holding a program's matrices as a [BLOCK, 4, 4] block and reducing along its axes instead took
43 us a launch for one token in a 40-layer V4.1 decode step on an H100 (bench/RESULTS.md,
2026-12-06): each sum went through Triton's cross-thread reductions.
"""

import triton
import triton.language as tl


@triton.jit
def _over_sum(a, b, c, d, eps):
    """Four entries of a row or column, each over their sum + eps."""
    total = a + b + c + d + eps
    return a / total, b / total, c / total, d / total


@triton.jit
def _softmax_row(ptr, live, eps):
    """A row's four logits read, softmaxed and each + eps (the first row pass)."""
    a, b = tl.load(ptr + 0, mask=live, other=0.0), tl.load(ptr + 1, mask=live, other=0.0)
    c, d = tl.load(ptr + 2, mask=live, other=0.0), tl.load(ptr + 3, mask=live, other=0.0)
    top = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a, b, c, d = _over_sum(tl.exp(a - top), tl.exp(b - top), tl.exp(c - top), tl.exp(d - top), 0.0)
    return a + eps, b + eps, c + eps, d + eps


@triton.jit
def _store_row(ptr, a, b, c, d, live):
    tl.store(ptr + 0, a, mask=live)
    tl.store(ptr + 1, b, mask=live)
    tl.store(ptr + 2, c, mask=live)
    tl.store(ptr + 3, d, mask=live)


@triton.jit
def sinkhorn4_kernel(logits_ptr, n, hc_eps, out_ptr, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    matrix = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = matrix < n  # lanes past n compute on zeros, stored nowhere
    src = logits_ptr + matrix * 16
    x00, x01, x02, x03 = _softmax_row(src + 0, live, hc_eps)
    x10, x11, x12, x13 = _softmax_row(src + 4, live, hc_eps)
    x20, x21, x22, x23 = _softmax_row(src + 8, live, hc_eps)
    x30, x31, x32, x33 = _softmax_row(src + 12, live, hc_eps)
    for i in tl.static_range(ITERS):
        if i > 0:  # rows; the softmax was the first pass's
            x00, x01, x02, x03 = _over_sum(x00, x01, x02, x03, hc_eps)
            x10, x11, x12, x13 = _over_sum(x10, x11, x12, x13, hc_eps)
            x20, x21, x22, x23 = _over_sum(x20, x21, x22, x23, hc_eps)
            x30, x31, x32, x33 = _over_sum(x30, x31, x32, x33, hc_eps)
        x00, x10, x20, x30 = _over_sum(x00, x10, x20, x30, hc_eps)  # columns
        x01, x11, x21, x31 = _over_sum(x01, x11, x21, x31, hc_eps)
        x02, x12, x22, x32 = _over_sum(x02, x12, x22, x32, hc_eps)
        x03, x13, x23, x33 = _over_sum(x03, x13, x23, x33, hc_eps)
    dst = out_ptr + matrix * 16
    _store_row(dst + 0, x00, x01, x02, x03, live)
    _store_row(dst + 4, x10, x11, x12, x13, live)
    _store_row(dst + 8, x20, x21, x22, x23, live)
    _store_row(dst + 12, x30, x31, x32, x33, live)
