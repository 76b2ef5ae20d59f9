"""Multi-head latent attention (MLA, DeepSeek-V2/V3, GLM-5): the compressed latent is the KV cache
(kv_lora_rank + qk_rope_head_dim values a token, as DeepSeek's own inference keeps it) and
kv_b_proj is absorbed into the query and the output, so attention runs on the latent.

The config is read by field name (num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
qk_rope_head_dim, v_head_dim, rope_interleave, latent_norm_eps (the q_a and kv_a norms),
hidden_size, softmax_scale, num_layers), so any family whose config has them uses this layer.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax.numpy as jnp

from tidejax import ops
from tidejax.checkpoint import Rule
from tidejax.kv import paged
from tidejax.models.base import ParamSpec, declare
from tidejax.models.layers.linear import HIGHEST, Linear, linear_specs
from tidejax.models.layers.norm import RMSNorm, norm_specs
from tidejax.models.layers.rope import apply_rope


@flax.struct.dataclass
class MLACache:
    """The paged KV pool, per layer: latent [n_pages, page_size, c] (normalized kv latent) and
    rope_k [n_pages, page_size, r] (rotated key), shared by every sequence through block tables."""

    latent: tuple
    rope_k: tuple

    @staticmethod
    def create(cfg, n_pages: int, page_size: int, dtype) -> "MLACache":
        return MLACache(
            latent=tuple(jnp.zeros((n_pages, page_size, cfg.kv_lora_rank), dtype)
                         for _ in range(cfg.num_layers)),
            rope_k=tuple(jnp.zeros((n_pages, page_size, cfg.qk_rope_head_dim), dtype)
                         for _ in range(cfg.num_layers)))

    def axes(self) -> "MLACache":
        """The logical axes of each pool leaf (tidejax.parallel)."""
        return MLACache(latent=tuple(("pages", "page", "kv_lora") for _ in self.latent),
                        rope_k=tuple(("pages", "page", "rope") for _ in self.rope_k))

    @staticmethod
    def bytes_per_token(cfg, dtype) -> int:
        return (cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                * jnp.dtype(dtype).itemsize)


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
    def __call__(self, x, positions, cos, sin, latent_pages, rope_pages, slots, block_table):
        """x [b, t, d]; latent_pages [n_pages, page_size, c] and rope_pages [.., r]: this layer's
        KV pool; slots [b, t]: where each token's keys go (tidejax.kv.paged.token_slots);
        block_table [b, P]: each row's pages -> (out [b, t, d], latent_pages, rope_pages)."""
        _, q_latent, q_rope, w_uv, latent_pages, rope_pages = mla_queries(
            self, x, cos, sin, latent_pages, rope_pages, slots)
        out_latent = ops.mla_attention(q_latent, q_rope, latent_pages, rope_pages, block_table,
                                       positions, scale=self.cfg.softmax_scale)
        return mla_output(self, out_latent, w_uv), latent_pages, rope_pages


def mla_queries(module: nn.Module, x, cos, sin, latent_pages, rope_pages, slots):
    """MLA's projections, made in `module`'s scope (MLAttention, or an attention that attends
    the latent otherwise: GLM-5's DSA): the keys written into the pages, kv_b absorbed into the
    queries -> (q_res [b, t, q_lora] (the normed query latent; None without q_lora_rank),
    q_latent [b, t, h, c], q_rope [b, t, h, r], w_uv [h, v, c] (kv_b's value rows, for
    mla_output), latent_pages, rope_pages)."""
    cfg, dt = module.cfg, module.dtype
    b, t, _ = x.shape
    h, nope, r, c = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        q_res, q = None, Linear(h * (nope + r), dt, name="q_proj")(x)
    else:
        q_res = RMSNorm(cfg.latent_norm_eps, dt, name="q_a_norm")(
            Linear(cfg.q_lora_rank, dt, name="q_a_proj")(x))
        q = Linear(h * (nope + r), dt, name="q_b_proj")(q_res)
    q = q.reshape(b, t, h, nope + r)
    q_nope, q_rope = q[..., :nope], apply_rope(q[..., nope:], cos, sin, cfg.rope_interleave)

    kv = Linear(c + r, dt, name="kv_a_proj")(x)  # [b, t, c + r]
    latent = RMSNorm(cfg.latent_norm_eps, dt, name="kv_a_norm")(kv[..., :c])
    rope_k = apply_rope(kv[..., c:], cos, sin, cfg.rope_interleave)
    latent_pages = paged.write(latent_pages, latent, slots)
    rope_pages = paged.write(rope_pages, rope_k, slots)
    # Absorb kv_b into the query (keys) and the output (values): attention runs on the latent.
    v = cfg.v_head_dim
    kv_b = declare(module, mla_specs(cfg, dt))["kv_b_proj"]
    kv_b = kv_b.reshape(h, nope + v, c).astype(x.dtype)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # [h, k, c], [h, v, c]
    q_latent = jnp.einsum("bthk,hkc->bthc", q_nope, w_uk, precision=HIGHEST)
    return q_res, q_latent, q_rope, w_uv, latent_pages, rope_pages


def mla_output(module: nn.Module, out_latent, w_uv):
    """The attended latent [b, t, h, c] through kv_b's value rows w_uv [h, v, c] and o_proj (made
    in `module`'s scope) -> [b, t, d]."""
    cfg = module.cfg
    b, t, h, _ = out_latent.shape
    out = jnp.einsum("bthc,hvc->bthv", out_latent, w_uv, precision=HIGHEST)
    return Linear(cfg.hidden_size, module.dtype, name="o_proj")(
        out.reshape(b, t, h * cfg.v_head_dim))


# the Hugging Face names of MLAttention's tensors (a decoder layer's prefix: field i)
MLA_RULES = (
    Rule("model.layers.{i}.self_attn.{proj:q_proj|q_a_proj|q_b_proj|o_proj}.weight",
         "layers_{i}.attn.{proj}.weight"),
    Rule("model.layers.{i}.self_attn.q_a_layernorm.weight", "layers_{i}.attn.q_a_norm.weight"),
    Rule("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight",
         "layers_{i}.attn.kv_a_proj.weight"),
    Rule("model.layers.{i}.self_attn.kv_a_layernorm.weight", "layers_{i}.attn.kv_a_norm.weight"),
    Rule("model.layers.{i}.self_attn.kv_b_proj.weight", "layers_{i}.attn.kv_b_proj"),
)
