"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4 / V4.1): the residual is `hc` parallel
streams; each block reads a weighted collapse of them (pre) and writes its output back with
per-stream gains (post) plus a doubly stochastic mix of the old streams (comb, by Sinkhorn:
ops.sinkhorn).
pre / post / comb come from one projection of the RMS-normalized, flattened streams: a site's
front half (the three and its collapsed input) is ops.mhc_front; the projection and the collapse
themselves are tidejax.contract's (hc_project, hc_collapse), which the models and ops.mhc_front's
reference call (its fused kernels compute the same in Triton).

Einsum letters: j, k streams (hc), d model width.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tidejax.contract import hc_project
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


def hc_head(streams, fn, base, scale, *, eps: float, hc_eps: float):
    """The final head's pre weights (DeepSeek-V4): streams [..., hc, d] -> pre [..., hc]."""
    return jax.nn.sigmoid(hc_project(streams, fn, eps) * scale[0] + base) + hc_eps


def hc_expand(y, residual, post, comb):
    """out_k = post_k * y + sum_j comb[j, k] * R_j."""
    mixed = jnp.einsum("...jk,...jd->...kd", comb, residual.astype(F32), precision=HIGHEST)
    return (post[..., None] * y.astype(F32)[..., None, :] + mixed).astype(residual.dtype)
