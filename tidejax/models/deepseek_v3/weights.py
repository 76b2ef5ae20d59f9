"""DeepSeek-V3 params, declared (the tree the flax model consumes), and the checkpoint table that
fills them; loading, test init and memory estimates come from these declarations."""

from __future__ import annotations

from tidejax.checkpoint import Table
from tidejax.models.deepseek_v3.config import DeepseekV3Config
from tidejax.models.deepseek_v3.model import router_spec
from tidejax.models.layers.decoder import decoder_expert_specs, decoder_specs, decoder_table
from tidejax.models.layers.mla import MLA_RULES, mla_specs
from tidejax.models.loading import load_by_table
from tidejax.residency.serve import ServeOptions


def param_specs(cfg: DeepseekV3Config, dtype) -> dict:
    """The dense params (everything but the routed experts) as ParamSpecs."""
    return decoder_specs(cfg, router_spec(cfg), lambda layer: mla_specs(cfg, dtype), dtype)


def expert_specs(cfg: DeepseekV3Config, dtype) -> dict:
    """The routed experts as host-pool rows (moe layer * n_routed_experts + expert)."""
    return decoder_expert_specs(cfg, dtype)


def checkpoint_table(cfg: DeepseekV3Config) -> Table:
    """Hugging Face tensor names -> the declared params and the routed-expert rows (the MTP
    layers and rotary caches ignored: layers/decoder.py)."""
    return decoder_table(cfg, MLA_RULES)


def load_weights(cfg: DeepseekV3Config, model_dir, raw_config: dict, serve: ServeOptions, dtype,
                 put_row):
    params = load_by_table(model_dir, raw_config, checkpoint_table(cfg), param_specs(cfg, dtype),
                           expert_specs(cfg, dtype), put_row)
    return params, None
