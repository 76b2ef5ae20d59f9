"""Mixtral: GQA attention (layers/gqa.py, every channel rotated) on the shared decoder stack
(layers/decoder.py), every layer a MoE: a softmax top-k router renormalized over the picks
(transformers' MixtralTopKRouter), no shared expert."""

from __future__ import annotations

from tidejax.models.layers.decoder import Decoder
from tidejax.models.layers.gqa import GQAttention
from tidejax.models.layers.moe import RouterSpec
from tidejax.models.mixtral.config import MixtralConfig
from tidejax.residency.serve import ServeOptions


def router_spec(cfg: MixtralConfig) -> RouterSpec:
    return RouterSpec(n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
                      scoring="softmax", use_bias=False, norm_topk_prob=True)


def build(cfg: MixtralConfig, serve: ServeOptions, dtype) -> Decoder:
    return Decoder(cfg, router_spec(cfg), lambda name, layer: GQAttention(cfg, dtype, name=name),
                   serve, dtype)
