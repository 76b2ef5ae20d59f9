"""Multi-head latent attention (MLA, DeepSeek-V2/V3, GLM-5): the compressed latent is the KV cache
(kv_lora_rank + qk_rope_head_dim values a token, as DeepSeek's own inference keeps it) and
kv_b_proj is absorbed into the query and the output, so attention runs on the latent.

The config is read by field name (num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
qk_rope_head_dim, v_head_dim, rope_interleave, rms_norm_eps, hidden_size, softmax_scale), so any
family whose config has them uses this layer.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from tidejax.kv import paged
from tidejax.models.base import ParamSpec
from tidejax.models.layers.linear import HIGHEST, Linear, linear_specs
from tidejax.models.layers.norm import RMSNorm, norm_specs
from tidejax.models.layers.rope import apply_rope


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
    kernel: str = "auto"  # the decode attention kernel: "auto" | "pallas" | "reference"

    @nn.compact
    def __call__(self, x, positions, cos, sin, latent_pages, rope_pages, slots, block_table):
        """x [b, t, d]; latent_pages [n_pages, page_size, c] and rope_pages [.., r]: this layer's
        KV pool; slots [b, t]: where each token's keys go (tidejax.kv.paged.token_slots);
        block_table [b, P]: each row's pages -> (out [b, t, d], latent_pages, rope_pages)."""
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
        latent_pages = paged.write(latent_pages, latent, slots)
        rope_pages = paged.write(rope_pages, rope_k, slots)

        # Absorb kv_b into the query (keys) and the output (values): attention runs on the latent.
        kv_b = self.param("kv_b_proj", nn.initializers.normal(0.02), (h * (nope + v), c), dt)
        kv_b = kv_b.reshape(h, nope + v, c).astype(x.dtype)
        w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # [h, k, c], [h, v, c]
        q_latent = jnp.einsum("bthk,hkc->bthc", q_nope, w_uk, precision=HIGHEST)
        out_latent = paged.mla_attention(q_latent, q_rope, latent_pages, rope_pages, block_table,
                                         positions, scale=cfg.softmax_scale,
                                         impl=self.kernel)
        out = jnp.einsum("bthc,hvc->bthv", out_latent, w_uv, precision=HIGHEST)
        out = Linear(cfg.hidden_size, dt, name="o_proj")(out.reshape(b, t, h * v))
        return out, latent_pages, rope_pages
