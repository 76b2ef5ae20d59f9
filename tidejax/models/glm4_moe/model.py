"""GLM-4.5 / 4.6 / 4.7 / 4.5-Air: GQA attention (partial rotary, q/k norm and q/k/v biases where
the config says) on the shared decoder stack (layers/decoder.py), sigmoid-routed MoE with shared
experts, dense MLPs in the first_k_dense_replace layers; the paged pool holds each layer's keys
and values per KV head.
"""

from __future__ import annotations

from tidejax.models.glm4_moe.config import Glm4MoeConfig
from tidejax.models.layers.decoder import Decoder
from tidejax.models.layers.gqa import GQAttention
from tidejax.models.layers.moe import RouterSpec
from tidejax.residency.serve import ServeOptions


def router_spec(cfg: Glm4MoeConfig) -> RouterSpec:
    """Sigmoid scores; the correction bias shifts the choice; groups ranked by the sum of their
    top-2 biased scores (transformers' Glm4MoeTopkRouter)."""
    return RouterSpec(
        n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, scoring="sigmoid",
        n_group=cfg.n_group, topk_group=cfg.topk_group, group_score="top2_sum", use_bias=True,
        norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor)


def build(cfg: Glm4MoeConfig, serve: ServeOptions, dtype) -> Decoder:
    return Decoder(cfg, router_spec(cfg), lambda name: GQAttention(cfg, dtype, name=name), serve,
                   dtype)
