"""Layers shared by the model families: RMSNorm, rotary embeddings, the SwiGLU MLP.

Einsum letters used across tidejax.models:
  b batch, t query tokens, s key/cache positions, d model width, h heads,
  k head width (query/key), v head width (value), c compressed latent (MLA kv_lora_rank),
  r rotary width, f feed-forward width, e experts.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tidejax.config import RopeConfig

HIGHEST = jax.lax.Precision.HIGHEST


def dense_init(stddev: float = 0.02):
    return nn.initializers.normal(stddev)


class Linear(nn.Module):
    """y = x @ W^T with W stored [out, in] as in Hugging Face checkpoints."""

    features: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", dense_init(), (self.features, x.shape[-1]), self.dtype)
        return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), precision=HIGHEST)


class RMSNorm(nn.Module):
    """Normalizes in float32, casts back, then scales (as the reference implementations do)."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        return w.astype(x.dtype) * rms_normalize(x, self.eps)


def rms_normalize(x, eps: float):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32.astype(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense MLP and the shared experts."""

    intermediate: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        gate = Linear(self.intermediate, self.dtype, name="gate_proj")(x)
        up = Linear(self.intermediate, self.dtype, name="up_proj")(x)
        return Linear(x.shape[-1], self.dtype, name="down_proj")(jax.nn.silu(gate) * up)


# ---------------------------------------------------------------------------------------------
# Rotary embeddings


def rope_frequencies(rope: RopeConfig) -> tuple[np.ndarray, float]:
    """Returns (inv_freq [dim/2] float32, attention_factor) for the default or YaRN scheme."""
    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv_extrapolation = 1.0 / pos_freqs
    if rope.kind == "default":
        return inv_extrapolation.astype(np.float32), 1.0
    factor = rope.factor
    inv_interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))
                ) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = inv_interpolation * (1 - extrapolation_weight) + inv_extrapolation * extrapolation_weight
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_ratio(factor, rope.mscale, rope.mscale_all_dim)
    else:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq.astype(np.float32), attention_factor


def yarn_ratio(factor: float, mscale: float, mscale_all_dim: float) -> float:
    def get(m):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    return get(mscale) / get(mscale_all_dim)


def rope_cos_sin(positions, inv_freq: np.ndarray, attention_factor: float):
    """positions [..., t] int -> cos, sin [..., t, r/2] float32 (already scaled)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x, cos, sin, interleaved: bool):
    """Rotates the last axis of x [..., t, (h,) r] by cos/sin [..., t, r/2].

    interleaved: channel pairs (2m, 2m+1) share a frequency (DeepSeek's layout); the result is
    written de-interleaved ([evens rotated, odds rotated]), as transformers does. Queries and keys
    get the same permutation, so their dot products equal the interleaved rotation's.
    Otherwise: the rotate-half layout, pairs (m, m + r/2).
    """
    if x.ndim == cos.ndim + 1:  # a heads axis between t and r
        cos, sin = cos[..., None, :], sin[..., None, :]
    xf = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
