"""GLM-4.5 params, declared (the tree the flax model consumes), and the checkpoint table that fills
them from the published layout (per-expert tensors, BF16 or FP8 with 128 x 128 block scales) or
the one transformers 5 holds in memory (fused experts)."""

from __future__ import annotations

from tidejax.checkpoint import Experts, Rule, Table
from tidejax.models.base import ParamSpec
from tidejax.models.glm4_moe.config import Glm4MoeConfig
from tidejax.models.glm4_moe.model import router_spec
from tidejax.models.layers.gqa import gqa_specs
from tidejax.models.layers.mlp import swiglu_specs
from tidejax.models.layers.moe import moe_specs, routed_expert_specs
from tidejax.models.layers.norm import norm_specs
from tidejax.models.loading import load_by_table
from tidejax.residency.serve import ServeOptions


def param_specs(cfg: Glm4MoeConfig, dtype) -> dict:
    """The dense params (everything but the routed experts) as ParamSpecs."""
    d = cfg.hidden_size
    specs = {"embed": ParamSpec((cfg.vocab_size, d), dtype, ("vocab", "embed"), stddev=1.0),
             "norm": norm_specs(d, "embed", dtype)}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((cfg.vocab_size, d), dtype, ("vocab", "embed"))
    for i in range(cfg.num_layers):
        layer = {"input_norm": norm_specs(d, "embed", dtype), "attn": gqa_specs(cfg, dtype),
                 "post_attn_norm": norm_specs(d, "embed", dtype)}
        if i in cfg.moe_layers:
            layer["moe"] = moe_specs(router_spec(cfg), d, cfg.shared_intermediate_size, dtype)
        else:
            layer["mlp"] = swiglu_specs(d, cfg.intermediate_size, dtype)
        specs[f"layers_{i}"] = layer
    return specs


def expert_specs(cfg: Glm4MoeConfig, dtype) -> dict:
    """The routed experts as host-pool rows (moe layer * n_routed_experts + expert)."""
    n_moe, n_experts, hidden, inter = expert_dims(cfg)
    return routed_expert_specs(n_moe * n_experts, hidden, inter, dtype)


_LAYER = "model.layers.{i}"
_EXPERTS = r"{layer:model\.layers\.[0-9]+\.mlp}.experts"
RULES = (
    Rule("model.embed_tokens.weight", "embed"),
    Rule("model.norm.weight", "norm.weight"),
    Rule("lm_head.weight", "lm_head"),
    Rule(f"{_LAYER}.input_layernorm.weight", "layers_{i}.input_norm.weight"),
    Rule(f"{_LAYER}.post_attention_layernorm.weight", "layers_{i}.post_attn_norm.weight"),
    Rule(f"{_LAYER}.self_attn.{{proj:q_proj|k_proj|v_proj|o_proj}}.{{kind:weight|bias}}",
         "layers_{i}.attn.{proj}.{kind}"),
    Rule(f"{_LAYER}.self_attn.{{norm:q_norm|k_norm}}.weight", "layers_{i}.attn.{norm}.weight"),
    Rule(f"{_LAYER}.mlp.{{proj:gate|up|down}}_proj.weight", "layers_{i}.mlp.{proj}_proj.weight"),
    Rule(f"{_LAYER}.mlp.gate.weight", "layers_{i}.moe.gate_weight"),
    Rule(f"{_LAYER}.mlp.gate.e_score_correction_bias", "layers_{i}.moe.gate_bias"),
    Rule(f"{_LAYER}.mlp.shared_experts.{{proj:gate|up|down}}_proj.weight",
         "layers_{i}.moe.shared.{proj}_proj.weight"),
    # routed experts: published per-expert tensors (FP8 pairs allowed) or transformers 5's fused
    # [E, ...] tensors (MXFP4 blocks and scales too: the reader pairs those into one tensor)
    Experts(_EXPERTS + ".{expert}.{part:gate|up|down}_proj.weight"),
    Experts(_EXPERTS + ".{part:gate_up|down}_proj"),
)


def checkpoint_table(cfg: Glm4MoeConfig) -> Table:
    """Hugging Face tensor names -> the declared params and the routed-expert rows. Ignored: the
    multi-token-prediction layers after the last decoder layer (kept for speculative decoding
    by a later change) and the rotary caches some exports include."""
    mtp = tuple(f"model.layers.{cfg.num_layers + j}.{{rest:.*}}" for j in range(cfg.num_mtp_layers))
    return Table(RULES, ignore=mtp + ("{prefix:.*}rotary_emb.inv_freq",),
                 expert_layers=[f"model.layers.{i}.mlp" for i in cfg.moe_layers])


def expert_dims(cfg: Glm4MoeConfig) -> tuple[int, int, int, int]:
    return len(cfg.moe_layers), cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size


def load_weights(cfg: Glm4MoeConfig, model_dir, raw_config: dict, serve: ServeOptions, dtype,
                 put_row):
    params = load_by_table(model_dir, raw_config, checkpoint_table(cfg), param_specs(cfg, dtype),
                           expert_specs(cfg, dtype), put_row)
    return params, None
