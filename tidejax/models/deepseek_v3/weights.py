"""DeepSeek-V3 params and the checkpoint table that fills them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tidejax.models.deepseek_v3.config import DeepseekV3Config
from tidejax.models.deepseek_v3.model import MLACache, build
from tidejax.models.loading import load_by_table
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import all_resident_state


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


def param_shapes(cfg: DeepseekV3Config, serve: ServeOptions, dtype) -> dict:
    """The params pytree as ShapeDtypeStructs (nothing is allocated)."""
    n_moe, n_experts, hidden, inter = expert_dims(cfg)

    def init():
        pool = {"gate_up": jnp.zeros((n_moe * n_experts, 2 * inter, hidden), dtype),
                "down": jnp.zeros((n_moe * n_experts, hidden, inter), dtype)}
        experts = all_resident_state(pool, max(n_moe, 1))
        tokens = jnp.zeros((1, 1), jnp.int32)
        cache = MLACache.create(cfg, 1, 1, dtype)  # one page of one token
        serve_all = dataclasses.replace(serve, all_resident=True)  # the bank does not shape params
        return build(cfg, serve_all, dtype).init(jax.random.key(0), tokens, tokens, tokens > -1,
                                             cache, tokens, experts)["params"]
    return jax.eval_shape(init)


def replay_variables(cfg: DeepseekV3Config, ids) -> dict:
    """Recorded picks ids [b, t, L_moe, k] as the MoE layers' "replay" variables."""
    return {f"layers_{layer}": {"moe": {"ids": ids[:, :, m]}} for m, layer in enumerate(cfg.moe_layers)}


def load_weights(cfg: DeepseekV3Config, model_dir, raw_config: dict, serve: ServeOptions, dtype,
                 put_row):
    params = load_by_table(
        model_dir, raw_config, param_shapes=param_shapes(cfg, serve, dtype),
        table=checkpoint_table(cfg), ignored=ignored_tensors(cfg),
        expert_prefixes=expert_prefixes(cfg), expert_dims=expert_dims(cfg), dtype=dtype,
        put_row=put_row)
    return params, None
