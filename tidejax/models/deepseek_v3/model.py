"""DeepSeek-V3 (DeepSeek-V2-Lite shape, V3, R1, V3.1, Kimi K2): MLA attention, DeepSeekMoE with
shared experts, dense MLPs in the first_k_dense_replace layers.

`DeepseekV3.__call__(tokens, positions, token_mask, cache, block_table, experts)` is the one
forward used for prefill chunks, decode steps and full-sequence scoring: the cache is the paged KV
pool, keys are written into each row's pages at their positions first, then every query attends
to its row's positions <= its own.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax.numpy as jnp

from tidejax.kv import paged
from tidejax.kv.paged import PagedCache
from tidejax.models.deepseek_v3.config import DeepseekV3Config
from tidejax.models.layers.linear import HIGHEST
from tidejax.models.layers.mla import MLAttention
from tidejax.models.layers.mlp import SwiGLU
from tidejax.models.layers.moe import MoE, RouterSpec
from tidejax.models.layers.norm import RMSNorm
from tidejax.models.layers.rope import rope_cos_sin, rope_frequencies
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import ExpertState


@flax.struct.dataclass
class MLACache:
    """The paged KV pool, per layer: latent [n_pages, page_size, c] (normalized kv latent) and
    rope_k [n_pages, page_size, r] (rotated key), shared by every sequence through block tables."""

    latent: tuple
    rope_k: tuple

    @staticmethod
    def create(cfg: DeepseekV3Config, n_pages: int, page_size: int, dtype) -> "MLACache":
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
    def bytes_per_token(cfg: DeepseekV3Config, dtype) -> int:
        return cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * jnp.dtype(dtype).itemsize


def router_spec(cfg: DeepseekV3Config) -> RouterSpec:
    """noaux_tc: groups ranked by their top-2 biased scores; group_limited_greedy: by their best
    score; greedy: plain top-k over every expert (n_group is then not a limit)."""
    grouped = cfg.topk_method != "greedy"
    return RouterSpec(
        n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, scoring=cfg.scoring_func,
        n_group=cfg.n_group if grouped else 1, topk_group=cfg.topk_group if grouped else 1,
        group_score="top2_sum" if cfg.topk_method == "noaux_tc" else "max",
        use_bias=cfg.topk_method == "noaux_tc", norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor)


class DecoderLayer(nn.Module):
    cfg: DeepseekV3Config
    layer: int
    serve: ServeOptions
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, positions, token_mask, cos, sin, latent_pages, rope_pages, slots,
                 block_table, experts, replay=None):
        cfg, dt = self.cfg, self.dtype
        attn, latent_pages, rope_pages = MLAttention(cfg, dt, self.serve.kernel, name="attn")(
            RMSNorm(cfg.rms_norm_eps, dt, name="input_norm")(x), positions, cos, sin,
            latent_pages, rope_pages, slots, block_table)
        x = x + attn
        h = RMSNorm(cfg.rms_norm_eps, dt, name="post_attn_norm")(x)
        if self.layer in cfg.moe_layers:
            y, experts = MoE(router_spec(cfg), cfg.moe_layers.index(self.layer),
                             cfg.shared_intermediate_size, self.serve, dt,
                             name="moe")(h, token_mask, experts, replay=replay)
        else:
            y = SwiGLU(cfg.intermediate_size, dt, name="mlp")(h)
        return x + y, latent_pages, rope_pages, experts


class DeepseekV3(nn.Module):
    cfg: DeepseekV3Config
    serve: ServeOptions
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens, positions, token_mask, cache: PagedCache, block_table,
                 experts: ExpertState, replay=None):
        """tokens, positions [b, t] int32; token_mask [b, t] bool (False = padding); cache: the
        pool (MLACache; nothing per lane); block_table [b, P] int32: each row's pages in the
        pool; replay [b, t, L_moe, k]: recorded picks to route by (None: the routers choose)
        -> logits [b, t, vocab] float32, cache, experts."""
        cfg, dt = self.cfg, self.dtype
        embed = self.param("embed", nn.initializers.normal(1.0), (cfg.vocab_size, cfg.hidden_size), dt)
        x = jnp.take(embed, tokens, axis=0)
        inv_freq, attention_factor = rope_frequencies(cfg.rope)
        cos, sin = rope_cos_sin(positions, inv_freq, attention_factor)
        latents, ropes = list(cache.pages.latent), list(cache.pages.rope_k)
        n_pages, page_size = latents[0].shape[:2]
        slots = paged.token_slots(block_table, positions, token_mask, n_pages, page_size)
        for i in range(cfg.num_layers):
            x, latents[i], ropes[i], experts = DecoderLayer(cfg, i, self.serve, dt, name=f"layers_{i}")(
                x, positions, token_mask, cos, sin, latents[i], ropes[i], slots, block_table, experts,
                replay)
        x = RMSNorm(cfg.rms_norm_eps, dt, name="norm")(x)
        if cfg.tie_word_embeddings:
            head = embed
        else:
            head = self.param("lm_head", nn.initializers.normal(0.02), (cfg.vocab_size, cfg.hidden_size), dt)
        logits = jnp.einsum("btd,vd->btv", x.astype(jnp.float32), head.astype(jnp.float32),
                            precision=HIGHEST)
        return logits, PagedCache(MLACache(tuple(latents), tuple(ropes))), experts


def build(cfg: DeepseekV3Config, serve: ServeOptions, dtype) -> DeepseekV3:
    return DeepseekV3(cfg, serve, dtype)
