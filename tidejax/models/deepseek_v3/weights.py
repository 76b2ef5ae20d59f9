"""DeepSeek-V3 params, declared (the tree the flax model consumes), and the checkpoint table that
fills them."""

from __future__ import annotations

from tidejax.models.base import ParamSpec, abstract
from tidejax.models.deepseek_v3.config import DeepseekV3Config
from tidejax.models.deepseek_v3.model import router_spec
from tidejax.models.layers.mla import mla_specs
from tidejax.models.layers.mlp import swiglu_specs
from tidejax.models.layers.moe import moe_specs, routed_expert_specs
from tidejax.models.layers.norm import norm_specs
from tidejax.models.loading import load_by_table
from tidejax.residency.serve import ServeOptions


def checkpoint_table(cfg: DeepseekV3Config) -> dict[str, tuple]:
    """Hugging Face tensor name -> our param path, for everything but the routed experts."""
    table = {"model.embed_tokens.weight": ("embed",), "model.norm.weight": ("norm", "weight")}
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = ("lm_head",)
    attn = {"q_a_proj": "q_a_proj", "q_a_layernorm": "q_a_norm", "q_b_proj": "q_b_proj"}
    if cfg.q_lora_rank is None:
        attn = {"q_proj": "q_proj"}
    attn |= {"kv_a_proj_with_mqa": "kv_a_proj", "kv_a_layernorm": "kv_a_norm", "o_proj": "o_proj"}
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}", f"layers_{i}"
        table[f"{src}.input_layernorm.weight"] = (dst, "input_norm", "weight")
        table[f"{src}.post_attention_layernorm.weight"] = (dst, "post_attn_norm", "weight")
        for hf, ours in attn.items():
            table[f"{src}.self_attn.{hf}.weight"] = (dst, "attn", ours, "weight")
        table[f"{src}.self_attn.kv_b_proj.weight"] = (dst, "attn", "kv_b_proj")
        if i in cfg.moe_layers:
            table[f"{src}.mlp.gate.weight"] = (dst, "moe", "gate_weight")
            if cfg.topk_method == "noaux_tc":
                table[f"{src}.mlp.gate.e_score_correction_bias"] = (dst, "moe", "gate_bias")
            if cfg.n_shared_experts:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    table[f"{src}.mlp.shared_experts.{proj}.weight"] = (dst, "moe", "shared", proj, "weight")
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                table[f"{src}.mlp.{proj}.weight"] = (dst, "mlp", proj, "weight")
    return table


def expert_prefixes(cfg: DeepseekV3Config) -> list[str]:
    """The checkpoint prefix of each MoE layer's routed experts, in rowmap order."""
    return [f"model.layers.{i}.mlp" for i in cfg.moe_layers]


def ignored_tensors(cfg: DeepseekV3Config) -> tuple[str, ...]:
    """Checkpoint tensors this family does not use: the multi-token-prediction layers after the
    last decoder layer, and the rotary caches some exports include."""
    mtp = tuple(rf"^model\.layers\.{cfg.num_layers + j}\." for j in range(cfg.num_mtp_layers))
    return mtp + (r"rotary_emb\.inv_freq$",)


def expert_dims(cfg: DeepseekV3Config) -> tuple[int, int, int, int]:
    return len(cfg.moe_layers), cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size


def param_specs(cfg: DeepseekV3Config, dtype) -> dict:
    """The dense params (everything but the routed experts) as ParamSpecs."""
    d = cfg.hidden_size
    specs = {"embed": ParamSpec((cfg.vocab_size, d), dtype, ("vocab", "embed"), stddev=1.0),
             "norm": norm_specs(d, "embed", dtype)}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((cfg.vocab_size, d), dtype, ("vocab", "embed"))
    for i in range(cfg.num_layers):
        layer = {"input_norm": norm_specs(d, "embed", dtype), "attn": mla_specs(cfg, dtype),
                 "post_attn_norm": norm_specs(d, "embed", dtype)}
        if i in cfg.moe_layers:
            layer["moe"] = moe_specs(router_spec(cfg), d, cfg.shared_intermediate_size, dtype)
        else:
            layer["mlp"] = swiglu_specs(d, cfg.intermediate_size, dtype)
        specs[f"layers_{i}"] = layer
    return specs


def expert_specs(cfg: DeepseekV3Config, dtype) -> dict:
    """The routed experts as host-pool rows (moe layer * n_routed_experts + expert)."""
    n_moe, n_experts, hidden, inter = expert_dims(cfg)
    return routed_expert_specs(n_moe * n_experts, hidden, inter, dtype)


def replay_variables(cfg: DeepseekV3Config, ids) -> dict:
    """Recorded picks ids [b, t, L_moe, k] as the MoE layers' "replay" variables."""
    return {f"layers_{layer}": {"moe": {"ids": ids[:, :, m]}} for m, layer in enumerate(cfg.moe_layers)}


def load_weights(cfg: DeepseekV3Config, model_dir, raw_config: dict, serve: ServeOptions, dtype,
                 put_row):
    params = load_by_table(
        model_dir, raw_config, param_shapes=abstract(param_specs(cfg, dtype)),
        table=checkpoint_table(cfg), ignored=ignored_tensors(cfg),
        expert_prefixes=expert_prefixes(cfg), expert_dims=expert_dims(cfg), dtype=dtype,
        put_row=put_row)
    return params, None
