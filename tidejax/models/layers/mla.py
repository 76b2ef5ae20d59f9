"""Multi-head latent attention (MLA, DeepSeek-V2/V3, GLM-5): the compressed latent is the KV cache
(kv_lora_rank + qk_rope_head_dim values a token, as DeepSeek's own inference keeps it) and
kv_b_proj is absorbed into the query and the output, so attention runs on the latent.

The config is read by field name (num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
qk_rope_head_dim, v_head_dim, rope_interleave, rms_norm_eps, hidden_size, softmax_scale), so any
family whose config has them uses this layer.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tidejax.models.base import ParamSpec
from tidejax.models.layers.linear import HIGHEST, Linear, linear_specs
from tidejax.models.layers.norm import RMSNorm, norm_specs
from tidejax.models.layers.rope import apply_rope


def write_positions(cache_arr, values, positions):
    """cache_arr [b, s, ...] <- values [b, t, ...] at positions [b, t]; out-of-range writes drop."""
    rows = jnp.arange(cache_arr.shape[0])[:, None]
    return cache_arr.at[rows, positions].set(values.astype(cache_arr.dtype), mode="drop")


def mla_specs(cfg, dtype) -> dict:
    """MLAttention's declared params (the config fields of the module docstring)."""
    h, nope, r, v, c = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                        cfg.v_head_dim, cfg.kv_lora_rank)
    d, q = cfg.hidden_size, cfg.num_heads * (nope + r)
    if cfg.q_lora_rank is None:
        specs = {"q_proj": linear_specs(q, d, ("heads", "embed"), dtype)}
    else:
        specs = {"q_a_proj": linear_specs(cfg.q_lora_rank, d, ("q_lora", "embed"), dtype),
                 "q_a_norm": norm_specs(cfg.q_lora_rank, "q_lora", dtype),
                 "q_b_proj": linear_specs(q, cfg.q_lora_rank, ("heads", "q_lora"), dtype)}
    return specs | {"kv_a_proj": linear_specs(c + r, d, ("kv_lora", "embed"), dtype),
                    "kv_a_norm": norm_specs(c, "kv_lora", dtype),
                    "kv_b_proj": ParamSpec((h * (nope + v), c), dtype, ("heads", "kv_lora")),
                    "o_proj": linear_specs(d, h * v, ("embed", "heads"), dtype)}


class MLAttention(nn.Module):
    cfg: object  # a config with the fields the module docstring names
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, positions, cos, sin, latent_cache, rope_cache):
        cfg, dt = self.cfg, self.dtype
        b, t, _ = x.shape
        h, nope, r, v, c = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim, cfg.kv_lora_rank)
        if cfg.q_lora_rank is None:
            q = Linear(h * (nope + r), dt, name="q_proj")(x)
        else:
            q = Linear(cfg.q_lora_rank, dt, name="q_a_proj")(x)
            q = RMSNorm(cfg.rms_norm_eps, dt, name="q_a_norm")(q)
            q = Linear(h * (nope + r), dt, name="q_b_proj")(q)
        q = q.reshape(b, t, h, nope + r)
        q_nope, q_rope = q[..., :nope], apply_rope(q[..., nope:], cos, sin, cfg.rope_interleave)

        kv = Linear(c + r, dt, name="kv_a_proj")(x)  # [b, t, c + r]
        latent = RMSNorm(cfg.rms_norm_eps, dt, name="kv_a_norm")(kv[..., :c])
        rope_k = apply_rope(kv[..., c:], cos, sin, cfg.rope_interleave)
        latent_cache = write_positions(latent_cache, latent, positions)
        rope_cache = write_positions(rope_cache, rope_k, positions)

        # Absorb kv_b into the query (keys) and the output (values): attention runs on the latent.
        kv_b = self.param("kv_b_proj", nn.initializers.normal(0.02), (h * (nope + v), c), dt)
        kv_b = kv_b.reshape(h, nope + v, c).astype(x.dtype)
        w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # [h, k, c], [h, v, c]
        q_latent = jnp.einsum("bthk,hkc->bthc", q_nope, w_uk, precision=HIGHEST)
        scores = (jnp.einsum("bthc,bsc->bhts", q_latent, latent_cache, precision=HIGHEST)
                  + jnp.einsum("bthr,bsr->bhts", q_rope, rope_cache, precision=HIGHEST))
        scores = scores.astype(jnp.float32) * cfg.softmax_scale
        visible = jnp.arange(latent_cache.shape[1])[None, None, :] <= positions[:, :, None]  # [b,t,s]
        scores = jnp.where(visible[:, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out_latent = jnp.einsum("bhts,bsc->bthc", probs, latent_cache, precision=HIGHEST)
        out = jnp.einsum("bthc,hvc->bthv", out_latent, w_uv, precision=HIGHEST)
        out = Linear(cfg.hidden_size, dt, name="o_proj")(out.reshape(b, t, h * v))
        return out, latent_cache, rope_cache
