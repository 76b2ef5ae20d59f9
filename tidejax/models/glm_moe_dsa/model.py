"""GLM-5.x: MLA with DeepSeek Sparse Attention (layers/dsa.py) on the shared decoder stack
(layers/decoder.py), its indexer's pick handed from each indexer layer to the "shared" layers
after it as the decoder's carry; sigmoid-routed MoE with a shared expert after the dense layers.
The paged pool holds each layer's MLA latent and rotated key and each indexer layer's keys.
"""

from __future__ import annotations

from tidejax.models.glm_moe_dsa.config import GlmMoeDsaConfig
from tidejax.models.layers.decoder import Decoder
from tidejax.models.layers.dsa import DSAttention
from tidejax.models.layers.moe import noaux_router
from tidejax.residency.serve import ServeOptions


def build(cfg: GlmMoeDsaConfig, serve: ServeOptions, dtype) -> Decoder:
    return Decoder(cfg, noaux_router(cfg),
                   lambda name, layer: DSAttention(cfg, layer, dtype, name=name),
                   serve, dtype, carries=True)
