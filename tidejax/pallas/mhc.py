"""The front half of an mHC site (DeepSeek-V4 / V4.1, models/layers/mhc.py): streams
[..., hc, d] and the site's (fn, base, scale) -> pre [..., hc], post [..., hc], comb
[..., hc, hc] and the collapsed input x = sum_j w_j X_j [..., d], w this site's pre or a given
one (V4.1 collapses by the previous site's). tidejax.ops.mhc_front picks between:

- `mhc_front_reference`: jnp, the RMS-normalized projection (contract.hc_project), sigmoids,
  Sinkhorn (the function it is given: ops.sinkhorn's choice) and the collapse
  (contract.hc_collapse). On the GPU that is many small launches a site, 80 sites a V4.1 step.
- `mhc_front_triton`: two Triton kernels (mhc_kernel) through jax-triton: a split-K projection
  that sums the squares for the RMS factor in the same pass, then one that finishes each token
  (partials summed, sigmoids, Sinkhorn in registers, the collapse). Off the GPU (interpret=True,
  tests) the same kernels run in Triton's interpreter on the host. Not yet run or timed on a
  GPU.
"""

from __future__ import annotations

import importlib.util
import math

import jax
import jax.numpy as jnp

from tidejax.contract import hc_collapse, hc_project
from tidejax.pallas.sinkhorn import MAX_HC, sinkhorn_reference
from tidejax.pallas.triton_host import launch

F32 = jnp.float32
BT, BK = 16, 128  # the projection's tile: tokens (tl.dot's least rows), columns a step
PROGRAMS = 256  # projection programs to aim for (about two an H100 SM): the splits of K
BLOCK, BD = 4, 512  # the finishing kernel's tokens and collapsed columns a program
SB = 32  # splits' partials the finishing kernel sums a load
NUM_WARPS = 4


def mhc_front_reference(streams, fn, base, scale, collapse_pre=None, *, eps: float,
                        hc_eps: float, iters: int, sinkhorn=sinkhorn_reference):
    """-> (pre, post, comb, x) as the models computed them before the fused form: fn
    [(2 + hc) * hc, hc * d] float32, base [(2 + hc) * hc], scale [3]; x collapsed by
    `collapse_pre` [..., hc] where given, else by pre."""
    hc = streams.shape[-2]
    m = hc_project(streams, fn, eps)
    pre = jax.nn.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * jax.nn.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*m.shape[:-1], hc, hc)
    comb = sinkhorn(logits, hc_eps=hc_eps, iters=iters)
    return pre, post, comb, hc_collapse(streams, pre if collapse_pre is None else collapse_pre)


def triton_supports(streams, fn) -> bool:
    """Whether the kernels take these shapes: hc <= MAX_HC, fn of (2 + hc) * hc rows over
    hc * d, bf16 or float32 streams, 32-bit offsets, and jax-triton installed (the GPU path's
    only way in)."""
    *lead, hc, d = streams.shape
    return (hc <= MAX_HC and fn.shape == ((2 + hc) * hc, hc * d)
            and streams.dtype in (jnp.bfloat16, F32) and math.prod(lead) * hc * d < 2**31
            and importlib.util.find_spec("jax_triton") is not None)


def split_k(n: int, k: int) -> tuple[int, int]:
    """(splits of K, BK steps a split): about PROGRAMS projection programs in all."""
    steps = -(-k // BK)
    per = -(-steps // max(1, min(steps, PROGRAMS // -(-n // BT))))
    return -(-steps // per), per


def mhc_front_triton(streams, fn, base, scale, collapse_pre=None, *, eps: float, hc_eps: float,
                     iters: int, interpret: bool = False):
    """mhc_front_reference's result by the two kernels (mhc_kernel)."""
    *lead, hc, d = streams.shape
    n, outs = math.prod(lead), fn.shape[0]
    if n == 0:
        return mhc_front_reference(streams, fn, base, scale, collapse_pre, eps=eps,
                                   hc_eps=hc_eps, iters=iters)
    from tidejax.pallas.mhc_kernel import mhc_finish_kernel, mhc_project_kernel

    x = streams.reshape(n, hc * d)
    o_p = 1 << (outs - 1).bit_length()
    splits, per = split_k(n, hc * d)
    part, sq = launch(
        mhc_project_kernel, (-(-n // BT), splits), (x, fn.astype(F32)), (n,),
        (jax.ShapeDtypeStruct((splits, n, o_p), F32), jax.ShapeDtypeStruct((splits, n), F32)),
        dict(K=hc * d, O=outs, O_P=o_p, BT=BT, BK=BK, STEPS=per), num_warps=NUM_WARPS,
        interpret=interpret)
    given = collapse_pre is not None  # without one, base stands in for the pointer, never read
    pre_in = collapse_pre.reshape(n, hc).astype(F32) if given else base
    pre, post, comb, out = launch(
        mhc_finish_kernel, (-(-n // BLOCK), -(-d // BD)),
        (part, sq, base.astype(F32), scale.astype(F32), x, pre_in),
        (n, splits, float(eps), float(hc_eps)),
        (jax.ShapeDtypeStruct((n, hc), F32), jax.ShapeDtypeStruct((n, hc), F32),
         jax.ShapeDtypeStruct((n, hc * hc), F32), jax.ShapeDtypeStruct((n, d), streams.dtype)),
        dict(HC=hc, HC_P=1 << (hc - 1).bit_length(), D=d, O_P=o_p, ITERS=iters, BLOCK=BLOCK,
             BD=BD, SB=SB, GIVEN=given), num_warps=NUM_WARPS, interpret=interpret)
    return (pre.reshape(*lead, hc), post.reshape(*lead, hc), comb.reshape(*lead, hc, hc),
            out.reshape(*lead, d))
