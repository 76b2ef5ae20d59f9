"""Grouped-query attention (GLM-4.5 and the Llama-shaped families) on the paged pool: q, k, v
projections (with biases where the config says), RMSNorm of the queries and keys (q/k norm) where
it says, over each head (`qk_norm_span` "head": GLM-4.5, Qwen3) or over the whole projection of
all heads ("projection": MiniMax-M2), rotary on the first `rotary_dim` channels of each head
(partial rotary, rotate-half), keys and values cached per KV head.

The config is read by field name (hidden_size, num_heads, num_kv_heads, head_dim, rotary_dim,
attention_bias, use_qk_norm, qk_norm_span, rms_norm_eps), so any family whose config has them
uses this layer. Per layer, from the family's factory: `window` (> 0: a sliding window of that
many positions), `sinks` (a learned logit per head in the softmax's denominator) and `o_bias`
(the output projection's bias): gpt-oss.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax.numpy as jnp

from tidejax import ops
from tidejax.checkpoint import Rule
from tidejax.errors import ConfigError
from tidejax.fields import Fields
from tidejax.kv import paged
from tidejax.models.base import ParamSpec, declare
from tidejax.models.layers.decoder import LAYER, expert_dims
from tidejax.models.layers.linear import Linear, linear_specs
from tidejax.models.layers.norm import RMSNorm, norm_specs
from tidejax.models.layers.rope import apply_rope


@flax.struct.dataclass
class GQAPages:
    """The paged KV pool, per layer: k and v [n_pages, page_size, kv heads, head_dim] (keys
    rotated), shared by every sequence through block tables."""

    k: tuple
    v: tuple

    @staticmethod
    def create(cfg, n_pages: int, page_size: int, dtype) -> "GQAPages":
        def pool():
            return tuple(jnp.zeros((n_pages, page_size, cfg.num_kv_heads, cfg.head_dim), dtype)
                         for _ in range(cfg.num_layers))
        return GQAPages(k=pool(), v=pool())

    def axes(self) -> "GQAPages":
        """The logical axes of each pool leaf (tidejax.parallel): KV heads on "heads"."""
        leaf = ("pages", "page", "heads", None)
        return GQAPages(k=tuple(leaf for _ in self.k), v=tuple(leaf for _ in self.v))

    @staticmethod
    def bytes_per_token(cfg, dtype) -> int:
        return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def read_heads(f: Fields) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of a config.json (`f`): KV heads default to the query
    heads and must divide them; head_dim defaults to hidden_size / heads."""
    heads = f.req("num_attention_heads")
    kv_heads = f.opt("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ConfigError(f"{f.source}: field 'num_key_value_heads' = {kv_heads} does not "
                          f"divide num_attention_heads = {heads}")
    return heads, kv_heads, f.opt("head_dim", None) or f.req("hidden_size") // heads


def gqa_specs(cfg, dtype, sinks: bool = False, o_bias: bool = False) -> dict:
    """GQAttention's declared params (the config fields of the module docstring; `sinks` and
    `o_bias` as the module's fields)."""
    d, h, g, k = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    bias = cfg.attention_bias
    specs = {"q_proj": linear_specs(h * k, d, ("heads", "embed"), dtype, bias),
             "k_proj": linear_specs(g * k, d, ("heads", "embed"), dtype, bias),
             "v_proj": linear_specs(g * k, d, ("heads", "embed"), dtype, bias),
             "o_proj": linear_specs(d, h * k, ("embed", "heads"), dtype, o_bias)}
    if sinks:
        specs["sinks"] = ParamSpec((h,), jnp.float32, ("heads",), init="zeros")
    if cfg.use_qk_norm:  # over each head, or over the whole projection (qk_norm_span)
        whole = cfg.qk_norm_span == "projection"
        specs |= {"q_norm": norm_specs(h * k if whole else k, None, dtype),
                  "k_norm": norm_specs(g * k if whole else k, None, dtype)}
    return specs


# Hugging Face names of GQAttention's tensors (q/k norm and biases where the checkpoint has them)
GQA_RULES = (
    Rule(f"{LAYER}.self_attn.{{proj:q_proj|k_proj|v_proj|o_proj}}.{{kind:weight|bias}}",
         "layers_{i}.attn.{proj}.{kind}"),
    Rule(f"{LAYER}.self_attn.{{norm:q_norm|k_norm}}.weight", "layers_{i}.attn.{norm}.weight"),
)


class GQAttention(nn.Module):
    cfg: object  # a config with the fields the module docstring names
    dtype: jnp.dtype
    window: int = 0  # > 0: a query at q sees positions > q - window
    sinks: bool = False  # a learned sink logit per head
    o_bias: bool = False

    @nn.compact
    def __call__(self, x, positions, cos, sin, k_pages, v_pages, slots, block_table):
        """x [b, t, d]; cos, sin [b, t, rotary_dim / 2]; k_pages, v_pages [n_pages, page_size,
        g, k]: this layer's KV pool; slots [b, t]: where each token's keys go
        (tidejax.kv.paged.token_slots); block_table [b, P]: each row's pages
        -> (out [b, t, d], k_pages, v_pages)."""
        cfg, dt = self.cfg, self.dtype
        p = declare(self, gqa_specs(cfg, dt, self.sinks, self.o_bias))
        b, t, _ = x.shape
        h, g, k, r = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim
        q = Linear(h * k, dt, cfg.attention_bias, name="q_proj")(x)
        key = Linear(g * k, dt, cfg.attention_bias, name="k_proj")(x)
        value = Linear(g * k, dt, cfg.attention_bias, name="v_proj")(x).reshape(b, t, g, k)
        if cfg.use_qk_norm and cfg.qk_norm_span == "projection":
            q = RMSNorm(cfg.rms_norm_eps, dt, name="q_norm")(q)
            key = RMSNorm(cfg.rms_norm_eps, dt, name="k_norm")(key)
        q, key = q.reshape(b, t, h, k), key.reshape(b, t, g, k)
        if cfg.use_qk_norm and cfg.qk_norm_span == "head":
            q = RMSNorm(cfg.rms_norm_eps, dt, name="q_norm")(q)
            key = RMSNorm(cfg.rms_norm_eps, dt, name="k_norm")(key)

        def rotate(heads):  # the first r channels of each head; the rest pass as they are
            return jnp.concatenate(
                [apply_rope(heads[..., :r], cos, sin, interleaved=False), heads[..., r:]], -1)

        q, key = rotate(q), rotate(key)
        k_pages = paged.write(k_pages, key, slots)
        v_pages = paged.write(v_pages, value, slots)
        # the paged GQA kernel (decode or a prompt chunk) on a GPU, its jnp reference elsewhere
        out = ops.gqa_attention(q, k_pages, v_pages, block_table, positions, scale=k ** -0.5,
                                sinks=p.get("sinks"), window=self.window)
        out = Linear(cfg.hidden_size, dt, self.o_bias, name="o_proj")(out.reshape(b, t, h * k))
        return out, k_pages, v_pages


# the Family fields (tidejax.models.base) every GQA family on the shared decoder has alike: its
# routed experts, its pool (attention through ops.gqa_attention, the paged GQA kernel or its
# reference, both reading up to the rows' positions: its block tables are max_context wide,
# Family.table_widths)
GQA_FAMILY = dict(expert_dims=expert_dims, top_k=lambda cfg: cfg.num_experts_per_tok,
                  create_cache=GQAPages.create, cache_axes=GQAPages.axes,
                  cache_bytes_per_token=GQAPages.bytes_per_token)
