"""mHC's Sinkhorn (DeepSeek-V4 / V4.1): logits [..., hc(j), hc(k)] -> a (nearly) doubly
stochastic mix. tidejax.ops.sinkhorn picks between:

- `sinkhorn_reference`: jnp, a softmax over k and then a `fori_loop` of row and column
  normalizations. On the GPU each iteration is its own launches (bench/RESULTS.md, 2026-12-04:
  the loops are 1,520 iterations and 3.7-4.9 ms of a 40-layer V4.1 decode step).
- `sinkhorn_triton`: the whole loop in one Triton kernel (sinkhorn_kernel), called through
  jax-triton on the GPU. Pallas's Triton lowering is deprecated since jax 0.11, and Pallas
  Mosaic GPU lays arrays out for warpgroup matrix work, not [hc, hc] blocks a token; a Triton
  kernel keeps a token's 16 values in registers. Off the GPU (interpret=True, tests) the same
  kernel runs in Triton's interpreter on the host (triton_host.launch).
"""

from __future__ import annotations

import importlib.util
import math

import jax
import jax.numpy as jnp

from tidejax.pallas.triton_host import launch

F32 = jnp.float32
MAX_HC = 8  # the kernel holds [BLOCK, HC_P, HC_P] a program; V4 / V4.1 ship hc_mult 4
BLOCK = 16  # matrices a program


def sinkhorn_reference(logits, *, hc_eps: float, iters: int):
    """softmax over k, then alternate column and row normalizations (iters in all, the softmax's
    column pass first)."""
    comb = jax.nn.softmax(logits, -1) + hc_eps
    comb = comb / (jnp.sum(comb, -2, keepdims=True) + hc_eps)

    def step(_, c):
        c = c / (jnp.sum(c, -1, keepdims=True) + hc_eps)
        return c / (jnp.sum(c, -2, keepdims=True) + hc_eps)

    return jax.lax.fori_loop(0, iters - 1, step, comb)


def triton_supports(logits) -> bool:
    """Whether the kernel takes `logits` here: square [hc, hc] of hc <= MAX_HC, float32, and
    jax-triton installed (the GPU path's only way in)."""
    hc = logits.shape[-1]
    return (logits.shape[-2] == hc <= MAX_HC and logits.dtype == F32
            and importlib.util.find_spec("jax_triton") is not None)


def _meta(hc: int, iters: int) -> dict:
    return dict(HC=hc, HC_P=1 << (hc - 1).bit_length(), ITERS=iters, BLOCK=BLOCK)


def sinkhorn_triton(logits, *, hc_eps: float, iters: int, interpret: bool = False):
    """sinkhorn_reference's result by the Triton kernel: logits [..., hc, hc] float32."""
    *lead, hc, _ = logits.shape
    n = math.prod(lead)
    flat = logits.reshape(n, hc * hc)
    if n == 0:
        return logits
    from tidejax.pallas.sinkhorn_kernel import sinkhorn_kernel

    (out,) = launch(sinkhorn_kernel, (-(-n // BLOCK),), (flat,), (n, float(hc_eps)),
                    (jax.ShapeDtypeStruct(flat.shape, F32),), _meta(hc, iters), num_warps=1,
                    interpret=interpret)
    return out.reshape(logits.shape)
