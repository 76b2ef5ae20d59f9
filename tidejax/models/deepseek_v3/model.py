"""DeepSeek-V3 (DeepSeek-V2-Lite shape, V3, R1, V3.1, Kimi K2): MLA attention, DeepSeekMoE with
shared experts, dense MLPs in the first_k_dense_replace layers, on the shared decoder stack
(layers/decoder.py); the paged pool holds each layer's MLA latent and rotated key. The MTP
layers' draft forward (layers/mtp.py) on the same MLA attention, which the engine's steps run
with [speculative] method "mtp" (runtime/speculative.py).
"""

from __future__ import annotations

from tidejax.models.deepseek_v3.config import DeepseekV3Config
from tidejax.models.layers.decoder import Decoder
from tidejax.models.layers.mla import MLAttention
from tidejax.models.layers.moe import RouterSpec
from tidejax.models.layers.mtp import MTP
from tidejax.residency.serve import ServeOptions


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


def build(cfg: DeepseekV3Config, serve: ServeOptions, dtype) -> Decoder:
    """The shared decoder stack (layers/decoder.py) with MLA attention."""
    return Decoder(cfg, router_spec(cfg),
                   lambda name, layer: MLAttention(cfg, dtype, name=name),
                   serve, dtype)


def build_mtp(cfg: DeepseekV3Config, serve: ServeOptions, dtype, depth: int = 0) -> MTP:
    """MTP layer `depth`'s draft forward (layers/mtp.py) with MLA attention."""
    return MTP(cfg, router_spec(cfg), lambda name, layer: MLAttention(cfg, dtype, name=name),
               serve, dtype, depth)
