"""RMSNorm, and LayerNorm (GLM-5's indexer keys)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tidejax.models.base import ParamSpec, declare


def norm_specs(dim: int, axis: str, dtype) -> dict:
    """RMSNorm's declared params: {"weight": [dim]} (ones)."""
    return {"weight": ParamSpec((dim,), dtype, (axis,), init="ones")}


class RMSNorm(nn.Module):
    """Normalizes in float32, casts back, then scales (as the reference implementations do)."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        w = declare(self, norm_specs(x.shape[-1], None, self.dtype))["weight"]
        return w.astype(x.dtype) * rms_normalize(x, self.eps)


def rms_normalize(x, eps: float):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32.astype(x.dtype)


def layer_norm_specs(dim: int, axis: str | None, dtype) -> dict:
    """LayerNorm's declared params: {"weight": [dim]} (ones), {"bias": [dim]} (zeros)."""
    return {"weight": ParamSpec((dim,), dtype, (axis,), init="ones"),
            "bias": ParamSpec((dim,), dtype, (axis,), init="zeros")}


class LayerNorm(nn.Module):
    """Mean and variance over the last axis in float32 (torch.nn.LayerNorm), then weight and
    bias."""

    eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        p = declare(self, layer_norm_specs(x.shape[-1], None, self.dtype))
        w, b = p["weight"], p["bias"]
        x32 = x.astype(jnp.float32)
        centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        x32 = centered * jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True)
                                       + self.eps)
        return (x32 * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)
