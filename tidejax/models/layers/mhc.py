"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4 / V4.1): the residual is `hc` parallel
streams; each block reads a weighted collapse of them (pre) and writes its output back with
per-stream gains (post) plus a doubly stochastic mix of the old streams (comb, by Sinkhorn:
ops.sinkhorn).
pre / post / comb come from one projection of the RMS-normalized, flattened streams.

Einsum letters: j, k streams (hc), d model width.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tidejax import ops
from tidejax.models.base import ParamSpec, declare
from tidejax.models.layers.linear import HIGHEST

F32 = jnp.float32


def mhc_specs(prefix: str, hc: int, d: int, head: bool = False) -> dict:
    """The declared params of one mHC site: `{prefix}_fn`, `_base`, `_scale` (module docstring)."""
    outputs = hc if head else (2 + hc) * hc
    return {f"{prefix}_fn": ParamSpec((outputs, hc * d), F32, (None, None)),
            f"{prefix}_base": ParamSpec((outputs,), F32, (None,), init="zeros"),
            f"{prefix}_scale": ParamSpec((1 if head else 3,), F32, (None,), init="ones")}


def mhc_params(module: nn.Module, prefix: str, hc: int, d: int, head: bool = False):
    """Declares one mHC site's (fn, base, scale) on `module` (mhc_specs): a site mixes
    (2 + hc) * hc values (pre, post, comb); the final head (head=True) only hc pre weights."""
    p = declare(module, mhc_specs(prefix, hc, d, head))
    return p[f"{prefix}_fn"], p[f"{prefix}_base"], p[f"{prefix}_scale"]


def _project(streams, fn, eps: float):
    """streams [..., hc, d] -> fn @ rms_normalize(flattened streams): [..., outputs] float32."""
    flat = streams.reshape(*streams.shape[:-2], -1).astype(F32)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, -1, keepdims=True) + eps)
    return jnp.einsum("...i,oi->...o", flat, fn.astype(F32), precision=HIGHEST)


def hc_mixes(streams, fn, base, scale, *, eps: float, hc_eps: float, iters: int):
    """streams [..., hc, d] -> pre [..., hc], post [..., hc], comb [..., hc(j), hc(k)]."""
    hc = streams.shape[-2]
    m = _project(streams, fn, eps)
    pre = jax.nn.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * jax.nn.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*m.shape[:-1], hc, hc)
    return pre, post, ops.sinkhorn(logits, hc_eps=hc_eps, iters=iters)


def hc_head(streams, fn, base, scale, *, eps: float, hc_eps: float):
    """The final head's pre weights (DeepSeek-V4): streams [..., hc, d] -> pre [..., hc]."""
    return jax.nn.sigmoid(_project(streams, fn, eps) * scale[0] + base) + hc_eps


def hc_collapse(streams, pre):
    """sum_j pre_j * X_j: [..., hc, d], [..., hc] -> [..., d]."""
    return jnp.sum(pre[..., None] * streams.astype(F32), -2).astype(streams.dtype)


def hc_expand(y, residual, post, comb):
    """out_k = post_k * y + sum_j comb[j, k] * R_j."""
    mixed = jnp.einsum("...jk,...jd->...kd", comb, residual.astype(F32), precision=HIGHEST)
    return (post[..., None] * y.astype(F32)[..., None, :] + mixed).astype(residual.dtype)
