"""MiniMax-M2: GQA attention (layers/gqa.py: q/k norm over the whole projection, partial rotary)
on the shared decoder stack (layers/decoder.py), every layer a MoE: sigmoid scores, the
correction bias shifting the choice only, top-k renormalized (transformers' MiniMaxM2TopKRouter),
no shared expert."""

from __future__ import annotations

from tidejax.models.layers.decoder import Decoder
from tidejax.models.layers.gqa import GQAttention
from tidejax.models.layers.moe import RouterSpec
from tidejax.models.minimax_m2.config import MiniMaxM2Config
from tidejax.residency.serve import ServeOptions


def router_spec(cfg: MiniMaxM2Config) -> RouterSpec:
    return RouterSpec(n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
                      scoring="sigmoid", use_bias=True, norm_topk_prob=True)


def build(cfg: MiniMaxM2Config, serve: ServeOptions, dtype) -> Decoder:
    return Decoder(cfg, router_spec(cfg), lambda name, layer: GQAttention(cfg, dtype, name=name),
                   serve, dtype)
