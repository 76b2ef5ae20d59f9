"""GLM-5 params, declared (the tree the flax model consumes; the MTP layers, kept on the host as
stored), and the checkpoint table that fills them from the published layout (per-expert tensors,
BF16 or FP8 with 128 x 128 block scales) or the one transformers 5 holds in memory (fused
experts)."""

from __future__ import annotations

from tidejax.checkpoint import Table
from tidejax.models.glm_moe_dsa.config import GlmMoeDsaConfig
from tidejax.models.layers.decoder import (decoder_expert_specs, decoder_specs, decoder_table,
                                           load_with_mtp, mtp_rules)
from tidejax.models.layers.decoder import mtp_specs as decoder_mtp_specs
from tidejax.models.layers.dsa import DSA_RULES, dsa_specs
from tidejax.models.layers.moe import noaux_router
from tidejax.residency.serve import ServeOptions


def param_specs(cfg: GlmMoeDsaConfig, dtype) -> dict:
    """The dense params (everything but the routed experts and the MTP layers) as ParamSpecs."""
    return decoder_specs(cfg, noaux_router(cfg),
                         lambda layer: dsa_specs(cfg, dtype, layer in cfg.index_layers), dtype)


def expert_specs(cfg: GlmMoeDsaConfig, dtype) -> dict:
    """The routed experts as host-pool rows (moe layer * n_routed_experts + expert)."""
    return decoder_expert_specs(cfg, dtype)


def mtp_specs(cfg: GlmMoeDsaConfig, dtype) -> dict:
    """The MTP layers (layers/decoder.py), their attention DSA with its indexer."""
    return decoder_mtp_specs(cfg, noaux_router(cfg), dsa_specs(cfg, dtype, indexer=True), dtype)


def checkpoint_table(cfg: GlmMoeDsaConfig, mtp: bool = True) -> Table:
    """Hugging Face tensor names -> the declared params, the routed-expert rows and, where `mtp`,
    the MTP layers (else read past; rotary caches ignored: layers/decoder.py)."""
    return decoder_table(cfg, DSA_RULES, mtp_rules(cfg) if mtp and cfg.num_mtp_layers else None)


def load_weights(cfg: GlmMoeDsaConfig, model_dir, raw_config: dict, serve: ServeOptions, dtype,
                 put_row):
    """(dense params, the MTP layers as the host-side aux: {"layers_{i}": their tensors}, or None
    without them: decoder.load_with_mtp)."""
    return load_with_mtp(cfg, model_dir, raw_config, checkpoint_table, param_specs(cfg, dtype),
                         expert_specs(cfg, dtype), mtp_specs(cfg, dtype), put_row)
