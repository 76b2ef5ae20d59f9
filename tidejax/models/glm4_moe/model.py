"""GLM-4.5 / 4.6 / 4.7 / 4.5-Air: GQA attention (partial rotary, q/k norm and q/k/v biases where
the config says) on the shared decoder stack (layers/decoder.py), sigmoid-routed MoE with shared
experts, dense MLPs in the first_k_dense_replace layers; the paged pool holds each layer's keys
and values per KV head. The MTP layer's draft forward (layers/mtp.py) on the same GQA attention,
which the engine's steps run with [speculative] method "mtp" (runtime/speculative.py).
"""

from __future__ import annotations

from tidejax.models.glm4_moe.config import Glm4MoeConfig
from tidejax.models.layers.decoder import Decoder
from tidejax.models.layers.gqa import GQAttention
from tidejax.models.layers.moe import noaux_router as router_spec
from tidejax.models.layers.mtp import MTP
from tidejax.residency.serve import ServeOptions


def build(cfg: Glm4MoeConfig, serve: ServeOptions, dtype) -> Decoder:
    return Decoder(cfg, router_spec(cfg), lambda name, layer: GQAttention(cfg, dtype, name=name),
                   serve, dtype)


def build_mtp(cfg: Glm4MoeConfig, serve: ServeOptions, dtype, depth: int = 0) -> MTP:
    """MTP layer `depth`'s draft forward (layers/mtp.py) with GQA attention."""
    return MTP(cfg, router_spec(cfg), lambda name, layer: GQAttention(cfg, dtype, name=name),
               serve, dtype, depth)
