"""Rotary embeddings: the config read from config.json, default and YaRN frequencies, rotation
(whole head, interleaved or rotate-half; or the trailing channels in place, DeepSeek-V4 / V4.1)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from tidejax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: the frequencies (`inv_freq` over `dim` rotary channels) and the scale
    applied to cos/sin (YaRN's attention factor), plus the extra softmax scale YaRN's
    mscale_all_dim asks of MLA."""

    theta: float
    dim: int
    kind: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    @staticmethod
    def from_hf(raw: dict, dim: int, max_position: int, source: str) -> "RopeConfig":
        """Reads `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (published)."""
        params = dict(raw.get("rope_parameters") or {})
        scaling = raw.get("rope_scaling") or {}
        if not params.get("rope_type") and scaling:
            params.update(scaling)
        theta = params.get("rope_theta", raw.get("rope_theta"))
        if theta is None:
            raise ConfigError(f"{source}: missing required field 'rope_theta'")
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in ("default", "yarn"):
            raise ConfigError(f"{source}: field 'rope_parameters.rope_type' = {kind!r} is not "
                              "supported (default, yarn)")
        if kind == "default":
            return RopeConfig(theta=float(theta), dim=dim)
        omax = params.get("original_max_position_embeddings")
        if omax is None:
            raise ConfigError(f"{source}: YaRN needs 'original_max_position_embeddings'")
        factor = params.get("factor") or max_position / omax
        return RopeConfig(
            theta=float(theta), dim=dim, kind="yarn", factor=float(factor),
            original_max_position=int(omax),
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 0), mscale_all_dim=float(params.get("mscale_all_dim") or 0),
            attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))

    @property
    def softmax_mscale(self) -> float:
        """MLA multiplies its softmax scale by mscale(factor, mscale_all_dim) squared (YaRN)."""
        if self.kind != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


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
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)


def rope_cos_sin(positions, inv_freq: np.ndarray, attention_factor: float = 1.0):
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


def rope_tail(x, cos, sin, inverse: bool = False):
    """Rotates pairs (2m, 2m+1) of the trailing r channels of x [..., t, (h,) n] in place (the
    channel order is kept: the quantizer blocks and the grouped output see it). cos/sin
    [..., t, r/2]; inverse rotates by -angle (DeepSeek-V4 / V4.1 undo it on the output)."""
    if x.ndim == cos.ndim + 1:
        cos, sin = cos[..., None, :], sin[..., None, :]
    if inverse:
        sin = -sin
    r = 2 * cos.shape[-1]
    nope, rot = x[..., :-r], x[..., -r:].astype(jnp.float32)
    even, odd = rot[..., 0::2], rot[..., 1::2]
    rot = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], -1).reshape(rot.shape)
    return jnp.concatenate([nope, rot.astype(x.dtype)], -1)
