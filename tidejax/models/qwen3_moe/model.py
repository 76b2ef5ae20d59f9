"""Qwen3-MoE: GQA attention with q/k norm (layers/gqa.py, every channel rotated) on the shared
decoder stack (layers/decoder.py); a softmax top-k router over the routed experts, no shared
expert, no correction bias (transformers' Qwen3MoeTopKRouter)."""

from __future__ import annotations

from tidejax.models.layers.decoder import Decoder
from tidejax.models.layers.gqa import GQAttention
from tidejax.models.layers.moe import RouterSpec
from tidejax.models.qwen3_moe.config import Qwen3MoeConfig
from tidejax.residency.serve import ServeOptions


def router_spec(cfg: Qwen3MoeConfig) -> RouterSpec:
    return RouterSpec(n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
                      scoring="softmax", use_bias=False, norm_topk_prob=cfg.norm_topk_prob)


def build(cfg: Qwen3MoeConfig, serve: ServeOptions, dtype) -> Decoder:
    return Decoder(cfg, router_spec(cfg), lambda name, layer: GQAttention(cfg, dtype, name=name),
                   serve, dtype)
