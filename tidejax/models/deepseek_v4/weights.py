"""DeepSeek-V4 params (declared by the model: `param_shapes`) and the regex table from
transformers' tensor names that fills them; routed experts stay per layer as banks
{"gate_up" [E, 2I, D], "down" [E, D, I]}."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from tidejax.checkpoint import CheckpointReader
from tidejax.fields import ConfigError
from tidejax.models.deepseek_v4.config import V4Config
from tidejax.models.deepseek_v4.model import DeepseekV4, V4Cache

F32 = jnp.float32

# transformers' tensor names -> our params
_RULES = [  # (regex on the name without "model.", replacement path with "/" separators)
    (r"^embed_tokens\.weight$", "embed"), (r"^lm_head\.weight$", "lm_head"),
    (r"^norm\.weight$", "norm/weight"), (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^layers\.(\d+)\.(attn_hc|ffn_hc)\.(fn|base|scale)$", r"layers_\1_\2_\3"),
    (r"^layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$", r"layers_\1_\2/weight"),
    (r"^layers\.(\d+)\.self_attn\.(o_a_proj)\.weight$", r"layers_\1_self_attn/\2"),
    (r"^layers\.(\d+)\.self_attn\.sinks$", r"layers_\1_self_attn/sinks"),
    (r"^layers\.(\d+)\.self_attn\.(q_a_proj|q_a_norm|q_b_proj|kv_proj|kv_norm|o_b_proj)\.weight$",
     r"layers_\1_self_attn/\2/weight"),
    (r"^layers\.(\d+)\.self_attn\.compressor\.(kv_proj|gate_proj|kv_norm)\.weight$",
     r"layers_\1_self_attn/compressor/main/\2/weight"),
    (r"^layers\.(\d+)\.self_attn\.compressor\.position_bias$",
     r"layers_\1_self_attn/compressor/main/position_bias"),
    (r"^layers\.(\d+)\.self_attn\.compressor\.indexer\.(kv_proj|gate_proj|kv_norm)\.weight$",
     r"layers_\1_self_attn/compressor/indexer/keys/\2/weight"),
    (r"^layers\.(\d+)\.self_attn\.compressor\.indexer\.position_bias$",
     r"layers_\1_self_attn/compressor/indexer/keys/position_bias"),
    (r"^layers\.(\d+)\.self_attn\.compressor\.indexer\.(q_b_proj)\.weight$",
     r"layers_\1_self_attn/compressor/indexer/\2/weight"),
    (r"^layers\.(\d+)\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.weight$",
     r"layers_\1_self_attn/compressor/indexer/weights_proj/weight"),
    (r"^layers\.(\d+)\.mlp\.gate\.weight$", r"layers_\1_mlp/gate_weight"),
    (r"^layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$", r"layers_\1_mlp/gate_bias"),
    (r"^layers\.(\d+)\.mlp\.gate\.tid2eid$", r"layers_\1_mlp/tid2eid"),
    (r"^layers\.(\d+)\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$",
     r"layers_\1_mlp/shared/\2/weight"),
]
_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def param_shapes(cfg: V4Config) -> dict:
    """The flax param tree's shapes (nothing allocated)."""
    model = DeepseekV4(cfg, kernel="reference")
    e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    empty = [{"gate_up": jnp.zeros((e, 2 * i, d)), "down": jnp.zeros((e, d, i))}] * cfg.num_layers
    tok = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: model.init(
        jax.random.PRNGKey(0), tok, tok, tok >= 0, V4Cache.create(cfg, 1, 1), empty))["params"]


def load_state(cfg: V4Config, tensors: dict, source: str = "checkpoint") -> tuple[dict, list]:
    """transformers-named tensors (name -> array) -> ({"params": tree}, per-layer banks).
    Fails on any unmapped tensor, missing parameter or shape mismatch, naming it."""
    shapes = flatten_dict(param_shapes(cfg))
    params, banks = {}, [dict() for _ in range(cfg.num_layers)]
    for name, value in tensors.items():
        key = name.removeprefix("model.")
        if m := _EXPERTS.match(key):
            banks[int(m[1])]["gate_up" if m[2] == "gate_up_proj" else "down"] = jnp.asarray(value, F32)
            continue
        path = next((tuple(re.sub(rx, rep, key).split("/")) for rx, rep in _RULES if re.match(rx, key)), None)
        if path is None or path not in shapes:
            raise ConfigError(f"{source}: tensor {name} has no place in the model")
        if tuple(value.shape) != shapes[path].shape:
            raise ConfigError(f"{source}: tensor {name} has shape {tuple(value.shape)}, "
                              f"the config needs {shapes[path].shape}")
        params[path] = jnp.asarray(np.asarray(value), shapes[path].dtype)
    missing = [p for p in shapes if p not in params]
    if missing:
        raise ConfigError(f"{source}: no tensor for parameter {'/'.join(missing[0])}")
    for layer, bank in enumerate(banks):
        if set(bank) != {"gate_up", "down"}:
            raise ConfigError(f"{source}: layer {layer} lacks mlp.experts.gate_up_proj / down_proj")
    return {"params": unflatten_dict(params)}, banks


def load(model_dir) -> tuple[V4Config, dict, list]:
    """A transformers-layout folder (config.json + model.safetensors or an index of shards)
    -> (config, params, banks)."""
    model_dir = Path(model_dir)
    cfg = V4Config.from_file(model_dir)
    reader = CheckpointReader(model_dir)
    arrays = {name: reader.read(name) for name in reader.names()}
    params, banks = load_state(cfg, arrays, str(model_dir))
    return cfg, params, banks
