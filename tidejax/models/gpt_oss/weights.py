"""gpt-oss params, declared, and the checkpoint table that fills them from the layout
transformers 5 writes (bf16 or float32: the fused experts as it holds them, gate_up_proj
[E, D, 2I] with the gate and up columns interleaved, down_proj [E, I, D], their biases) or the
published one (MXFP4 gate_up_proj_blocks / _scales [E, 2I, D/32, ...] with the gate and up rows
interleaved, down_proj_blocks / _scales [E, D, I/32, ...], kept MXFP4 as stored; the reader pairs
blocks and scales into one tensor of the float name): the shared decoder's names
(layers/decoder.py), GQA's, the sinks and the router's."""

from __future__ import annotations

import numpy as np

from tidejax.checkpoint import Experts, Rule, Table, Transform
from tidejax.models.gpt_oss.config import GptOssConfig
from tidejax.models.gpt_oss.model import router_spec
from tidejax.models.layers.decoder import (LAYER, ROTARY_CACHES, decoder_expert_specs,
                                           decoder_specs, stack_rules)
from tidejax.models.layers.gqa import GQA_RULES, gqa_specs
from tidejax.models.loading import load_by_table
from tidejax.residency.serve import ServeOptions


def param_specs(cfg: GptOssConfig, dtype) -> dict:
    """The dense params (everything but the routed experts) as ParamSpecs."""
    return decoder_specs(cfg, router_spec(cfg),
                         lambda layer: gqa_specs(cfg, dtype, sinks=True, o_bias=True), dtype)


def expert_specs(cfg: GptOssConfig, dtype) -> dict:
    """The routed experts as host-pool rows (layer * n_routed_experts + expert), with biases."""
    return decoder_expert_specs(cfg, dtype, bias=True)


def _gate_then_up(a: np.ndarray) -> np.ndarray:
    """Rows [2I, ...] with gate and up interleaved (gate 2j, up 2j + 1) -> the contract's order,
    gate rows then up rows."""
    return np.concatenate([a[0::2], a[1::2]])


# each expert's slice: gate_up [D, 2I] interleaved -> [2I, D] gate rows then up; down [I, D] ->
# [D, I]; gate_up_bias [2I] interleaved -> gate then up (MXFP4: Experts.packed, else as stored)
GATE_UP = Transform("transposed, gate/up de-interleaved", lambda shape: shape[::-1],
                    lambda a: _gate_then_up(np.transpose(a)))
DEINTERLEAVED = Transform("gate/up de-interleaved", lambda shape: shape, _gate_then_up)
DOWN = Transform("transposed", lambda shape: shape[::-1], np.transpose)


def checkpoint_table(cfg: GptOssConfig) -> Table:
    """Hugging Face tensor names -> the declared params and the routed-expert rows."""
    experts = r"{layer:model\.layers\.[0-9]+\.mlp}.experts"
    return Table(stack_rules() + GQA_RULES + (
        Rule(f"{LAYER}.self_attn.sinks", "layers_{i}.attn.sinks"),
        Rule(f"{LAYER}.mlp.router.weight", "layers_{i}.moe.gate_weight"),
        Rule(f"{LAYER}.mlp.router.bias", "layers_{i}.moe.gate_bias"),
        Experts(experts + ".gate_up_proj", part="gate_up", transform=GATE_UP,
                packed=DEINTERLEAVED),  # MXFP4: rows already [2I, ...], still interleaved
        Experts(experts + ".gate_up_proj_bias", part="gate_up_bias", transform=DEINTERLEAVED),
        Experts(experts + ".down_proj", part="down", transform=DOWN),  # MXFP4: [D, I] as stored
        Experts(experts + ".down_proj_bias", part="down_bias"),
    ), ignore=ROTARY_CACHES, expert_layers=[f"model.layers.{i}.mlp" for i in cfg.moe_layers])


def load_weights(cfg: GptOssConfig, model_dir, raw_config: dict, serve: ServeOptions, dtype,
                 put_row):
    params = load_by_table(model_dir, raw_config, checkpoint_table(cfg), param_specs(cfg, dtype),
                           expert_specs(cfg, dtype), put_row)
    return params, None
