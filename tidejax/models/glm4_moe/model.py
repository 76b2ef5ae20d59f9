"""GLM-4.5 / 4.6 / 4.7 / 4.5-Air: GQA attention (partial rotary, q/k norm and q/k/v biases where
the config says) on the paged pool, sigmoid-routed MoE with shared experts, dense MLPs in the
first_k_dense_replace layers.

`Glm4Moe.__call__(tokens, positions, token_mask, cache, block_table, experts)` is the one forward
used for prefill chunks, decode steps and full-sequence scoring: each layer writes its keys and
values into the row's pages at their positions, then every query attends to its row's positions
<= its own.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from tidejax.kv import paged
from tidejax.kv.paged import PagedCache
from tidejax.models.glm4_moe.config import Glm4MoeConfig
from tidejax.models.layers.gqa import GQAPages, GQAttention
from tidejax.models.layers.linear import HIGHEST
from tidejax.models.layers.mlp import SwiGLU
from tidejax.models.layers.moe import MoE, RouterSpec
from tidejax.models.layers.norm import RMSNorm
from tidejax.models.layers.rope import rope_cos_sin, rope_frequencies
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import ExpertState


def router_spec(cfg: Glm4MoeConfig) -> RouterSpec:
    """Sigmoid scores; the correction bias shifts the choice; groups ranked by the sum of their
    top-2 biased scores (transformers' Glm4MoeTopkRouter)."""
    return RouterSpec(
        n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, scoring="sigmoid",
        n_group=cfg.n_group, topk_group=cfg.topk_group, group_score="top2_sum", use_bias=True,
        norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor)


class DecoderLayer(nn.Module):
    cfg: Glm4MoeConfig
    layer: int
    serve: ServeOptions
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, positions, token_mask, cos, sin, k_pages, v_pages, slots, block_table,
                 experts, replay=None):
        cfg, dt = self.cfg, self.dtype
        attn, k_pages, v_pages = GQAttention(cfg, dt, name="attn")(
            RMSNorm(cfg.rms_norm_eps, dt, name="input_norm")(x), positions, cos, sin,
            k_pages, v_pages, slots, block_table)
        x = x + attn
        h = RMSNorm(cfg.rms_norm_eps, dt, name="post_attn_norm")(x)
        if self.layer in cfg.moe_layers:
            y, experts = MoE(router_spec(cfg), cfg.moe_layers.index(self.layer),
                             cfg.shared_intermediate_size, self.serve, dt,
                             name="moe")(h, token_mask, experts, replay=replay)
        else:
            y = SwiGLU(cfg.intermediate_size, dt, name="mlp")(h)
        return x + y, k_pages, v_pages, experts


class Glm4Moe(nn.Module):
    cfg: Glm4MoeConfig
    serve: ServeOptions
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens, positions, token_mask, cache: PagedCache, block_table,
                 experts: ExpertState, replay=None):
        """tokens, positions [b, t] int32; token_mask [b, t] bool (False = padding); cache: the
        pool (GQAPages; nothing per lane); block_table [b, P] int32: each row's pages in the
        pool; replay [b, t, L_moe, k]: recorded picks to route by (None: the routers choose)
        -> logits [b, t, vocab] float32, cache, experts."""
        cfg, dt = self.cfg, self.dtype
        embed = self.param("embed", nn.initializers.normal(1.0), (cfg.vocab_size, cfg.hidden_size), dt)
        x = jnp.take(embed, tokens, axis=0)
        inv_freq, attention_factor = rope_frequencies(cfg.rope)
        cos, sin = rope_cos_sin(positions, inv_freq, attention_factor)
        ks, vs = list(cache.pages.k), list(cache.pages.v)
        n_pages, page_size = ks[0].shape[:2]
        slots = paged.token_slots(block_table, positions, token_mask, n_pages, page_size)
        for i in range(cfg.num_layers):
            x, ks[i], vs[i], experts = DecoderLayer(cfg, i, self.serve, dt, name=f"layers_{i}")(
                x, positions, token_mask, cos, sin, ks[i], vs[i], slots, block_table, experts,
                replay)
        x = RMSNorm(cfg.rms_norm_eps, dt, name="norm")(x)
        if cfg.tie_word_embeddings:
            head = embed
        else:
            head = self.param("lm_head", nn.initializers.normal(0.02), (cfg.vocab_size, cfg.hidden_size), dt)
        logits = jnp.einsum("btd,vd->btv", x.astype(jnp.float32), head.astype(jnp.float32),
                            precision=HIGHEST)
        return logits, PagedCache(GQAPages(tuple(ks), tuple(vs))), experts


def build(cfg: Glm4MoeConfig, serve: ServeOptions, dtype) -> Glm4Moe:
    return Glm4Moe(cfg, serve, dtype)
