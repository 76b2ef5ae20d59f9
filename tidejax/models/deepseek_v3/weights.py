"""DeepSeek-V3 params, declared (the tree the flax model consumes), and the checkpoint table that
fills them; loading, test init and memory estimates come from these declarations. The MTP
(NextN) layers a checkpoint carries are read into host arrays as stored, apart from the decoder's
params (layers/decoder.py mtp_specs), for speculative decoding (runtime/speculative.py)."""

from __future__ import annotations

from tidejax.checkpoint import Table
from tidejax.models.deepseek_v3.config import DeepseekV3Config
from tidejax.models.deepseek_v3.model import router_spec
from tidejax.models.layers.decoder import (decoder_expert_specs, decoder_specs, decoder_table,
                                           load_with_mtp, mtp_rules)
from tidejax.models.layers.decoder import mtp_specs as decoder_mtp_specs
from tidejax.models.layers.mla import MLA_RULES, mla_specs
from tidejax.residency.serve import ServeOptions


def param_specs(cfg: DeepseekV3Config, dtype) -> dict:
    """The dense params (everything but the routed experts) as ParamSpecs."""
    return decoder_specs(cfg, router_spec(cfg), lambda layer: mla_specs(cfg, dtype), dtype)


def expert_specs(cfg: DeepseekV3Config, dtype) -> dict:
    """The routed experts as host-pool rows (moe layer * n_routed_experts + expert)."""
    return decoder_expert_specs(cfg, dtype)


def mtp_specs(cfg: DeepseekV3Config, dtype) -> dict:
    """The MTP layers (layers/decoder.py), their attention MLA."""
    return decoder_mtp_specs(cfg, router_spec(cfg), mla_specs(cfg, dtype), dtype)


def checkpoint_table(cfg: DeepseekV3Config, mtp: bool = True) -> Table:
    """Hugging Face tensor names -> the declared params, the routed-expert rows and, where `mtp`,
    the MTP layers (else read past; rotary caches ignored: layers/decoder.py)."""
    return decoder_table(cfg, MLA_RULES, mtp_rules(cfg) if mtp and cfg.num_mtp_layers else None)


def load_weights(cfg: DeepseekV3Config, model_dir, raw_config: dict, serve: ServeOptions, dtype,
                 put_row):
    """(dense params, the MTP layers as the host-side aux: {"layers_{i}": their tensors}, or None
    without them: decoder.load_with_mtp)."""
    return load_with_mtp(cfg, model_dir, raw_config, checkpoint_table, param_specs(cfg, dtype),
                         expert_specs(cfg, dtype), mtp_specs(cfg, dtype), put_row)
