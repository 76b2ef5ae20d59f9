"""GLM-5.x: MLA with DeepSeek Sparse Attention (layers/dsa.py) on the shared decoder stack
(layers/decoder.py), its indexer's pick handed from each indexer layer to the "shared" layers
after it as the decoder's carry; sigmoid-routed MoE with a shared expert after the dense layers.
The paged pool holds each layer's MLA latent and rotated key and each indexer layer's keys. The
MTP layer's draft forward (layers/mtp.py) on DSA attention with its own indexer, which the
engine's steps run with [speculative] method "mtp" (runtime/speculative.py).
"""

from __future__ import annotations

from tidejax.models.glm_moe_dsa.config import GlmMoeDsaConfig
from tidejax.models.layers.decoder import Decoder
from tidejax.models.layers.dsa import DSAttention
from tidejax.models.layers.moe import noaux_router
from tidejax.models.layers.mtp import MTP
from tidejax.residency.serve import ServeOptions


def build(cfg: GlmMoeDsaConfig, serve: ServeOptions, dtype) -> Decoder:
    return Decoder(cfg, noaux_router(cfg),
                   lambda name, layer: DSAttention(cfg, layer, dtype, name=name),
                   serve, dtype, carries=True)


def build_mtp(cfg: GlmMoeDsaConfig, serve: ServeOptions, dtype, depth: int = 0) -> MTP:
    """MTP layer `depth`'s draft forward (layers/mtp.py) with DSA attention: the MTP layers are
    among cfg.index_layers, so each picks with its own indexer."""
    return MTP(cfg, noaux_router(cfg),
               lambda name, layer: DSAttention(cfg, layer, dtype, name=name),
               serve, dtype, depth, carries=True)
