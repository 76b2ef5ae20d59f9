"""mHC's Sinkhorn (DeepSeek-V4 / V4.1): logits [..., hc(j), hc(k)] -> a (nearly) doubly
stochastic mix. tidejax.ops.sinkhorn picks between:

- `sinkhorn_reference`: jnp, a softmax over k and then a `fori_loop` of row and column
  normalizations. On the GPU each iteration is its own launches (bench/RESULTS.md, 2026-12-04:
  the loops are 1,520 iterations and 3.7-4.9 ms of a 40-layer V4.1 decode step).
- `sinkhorn_triton`: the whole loop in one Triton kernel (sinkhorn_kernel), called through
  jax-triton on the GPU. Pallas's Triton lowering is deprecated since jax 0.11, and Pallas
  Mosaic GPU lays arrays out for warpgroup matrix work, not [hc, hc] blocks a token; a Triton
  kernel keeps a token's 16 values in registers. Off the GPU (interpret=True, tests) the same
  kernel runs in Triton's interpreter on the host (through jax.pure_callback and torch tensors,
  the interpreter's array type).
"""

from __future__ import annotations

import functools
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np

from tidejax.pallas.triton_host import run_interpreted

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


def _interpreted(flat: np.ndarray, hc_eps: float, iters: int) -> np.ndarray:
    """The kernel in Triton's interpreter on the host: flat [n, hc * hc] float32."""
    import torch

    from tidejax.pallas.sinkhorn_kernel import sinkhorn_kernel

    n, hc = flat.shape[0], math.isqrt(flat.shape[1])
    x = torch.from_numpy(np.array(flat, np.float32))  # a writable copy
    out = torch.zeros_like(x)
    grid = (max(1, -(-n // BLOCK)),)
    run_interpreted(sinkhorn_kernel, grid, x, n, float(hc_eps), out, **_meta(hc, iters))
    return out.numpy()


def sinkhorn_triton(logits, *, hc_eps: float, iters: int, interpret: bool = False):
    """sinkhorn_reference's result by the Triton kernel: logits [..., hc, hc] float32."""
    *lead, hc, _ = logits.shape
    n = math.prod(lead)
    flat = logits.reshape(n, hc * hc)
    if n == 0:
        return logits
    if interpret:
        out = jax.pure_callback(functools.partial(_interpreted, hc_eps=hc_eps, iters=iters),
                                jax.ShapeDtypeStruct(flat.shape, F32), flat)
        return out.reshape(logits.shape)
    import jax_triton

    from tidejax.pallas.sinkhorn_kernel import sinkhorn_kernel

    out = jax_triton.triton_call(flat, n, float(hc_eps), kernel=sinkhorn_kernel,
                                 out_shape=jax.ShapeDtypeStruct(flat.shape, F32),
                                 grid=(-(-n // BLOCK),), num_warps=1, **_meta(hc, iters))
    return out.reshape(logits.shape)
