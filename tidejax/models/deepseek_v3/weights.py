"""DeepSeek-V3 params, declared (the tree the flax model consumes), and the checkpoint table that
fills them; loading, test init and memory estimates come from these declarations."""

from __future__ import annotations

from tidejax.checkpoint import Rule, Table
from tidejax.models.deepseek_v3.config import DeepseekV3Config
from tidejax.models.deepseek_v3.model import router_spec
from tidejax.models.layers.decoder import LAYER, decoder_expert_specs, decoder_specs, decoder_table
from tidejax.models.layers.mla import mla_specs
from tidejax.models.loading import load_by_table
from tidejax.residency.serve import ServeOptions


def param_specs(cfg: DeepseekV3Config, dtype) -> dict:
    """The dense params (everything but the routed experts) as ParamSpecs."""
    return decoder_specs(cfg, router_spec(cfg), mla_specs(cfg, dtype), dtype)


def expert_specs(cfg: DeepseekV3Config, dtype) -> dict:
    """The routed experts as host-pool rows (moe layer * n_routed_experts + expert)."""
    return decoder_expert_specs(cfg, dtype)


ATTENTION_RULES = (
    Rule(f"{LAYER}.self_attn.{{proj:q_proj|q_a_proj|q_b_proj|o_proj}}.weight",
         "layers_{i}.attn.{proj}.weight"),
    Rule(f"{LAYER}.self_attn.q_a_layernorm.weight", "layers_{i}.attn.q_a_norm.weight"),
    Rule(f"{LAYER}.self_attn.kv_a_proj_with_mqa.weight", "layers_{i}.attn.kv_a_proj.weight"),
    Rule(f"{LAYER}.self_attn.kv_a_layernorm.weight", "layers_{i}.attn.kv_a_norm.weight"),
    Rule(f"{LAYER}.self_attn.kv_b_proj.weight", "layers_{i}.attn.kv_b_proj"),
)


def checkpoint_table(cfg: DeepseekV3Config) -> Table:
    """Hugging Face tensor names -> the declared params and the routed-expert rows (the MTP
    layers and rotary caches ignored: layers/decoder.py)."""
    return decoder_table(cfg, ATTENTION_RULES)


def load_weights(cfg: DeepseekV3Config, model_dir, raw_config: dict, serve: ServeOptions, dtype,
                 put_row):
    params = load_by_table(model_dir, raw_config, checkpoint_table(cfg), param_specs(cfg, dtype),
                           expert_specs(cfg, dtype), put_row)
    return params, None
