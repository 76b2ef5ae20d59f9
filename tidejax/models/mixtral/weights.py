"""Mixtral params, declared, and the checkpoint table that fills them from the published layout:
the shared decoder's embedding and norms, GQA's projections, and each layer's
`block_sparse_moe` (the router `gate`, per-expert w1 = gate, w3 = up, w2 = down)."""

from __future__ import annotations

from tidejax.checkpoint import Experts, Rule, Table
from tidejax.models.layers.decoder import (LAYER, ROTARY_CACHES, decoder_expert_specs,
                                           decoder_specs, stack_rules)
from tidejax.models.layers.gqa import GQA_RULES, gqa_specs
from tidejax.models.loading import load_by_table
from tidejax.models.mixtral.config import MixtralConfig
from tidejax.models.mixtral.model import router_spec
from tidejax.residency.serve import ServeOptions

_EXPERT = r"{layer:model\.layers\.[0-9]+\.block_sparse_moe}.experts.{expert}"


def param_specs(cfg: MixtralConfig, dtype) -> dict:
    """The dense params (everything but the routed experts) as ParamSpecs."""
    return decoder_specs(cfg, router_spec(cfg), lambda layer: gqa_specs(cfg, dtype), dtype)


def checkpoint_table(cfg: MixtralConfig) -> Table:
    """Hugging Face tensor names -> the declared params and the routed-expert rows."""
    return Table(stack_rules() + GQA_RULES + (
        Rule(f"{LAYER}.block_sparse_moe.gate.weight", "layers_{i}.moe.gate_weight"),
        Experts(_EXPERT + ".w1.weight", part="gate"),
        Experts(_EXPERT + ".w3.weight", part="up"),
        Experts(_EXPERT + ".w2.weight", part="down"),
    ), ignore=ROTARY_CACHES,
        expert_layers=[f"model.layers.{i}.block_sparse_moe" for i in cfg.moe_layers])


def load_weights(cfg: MixtralConfig, model_dir, raw_config: dict, serve: ServeOptions, dtype,
                 put_row):
    params = load_by_table(model_dir, raw_config, checkpoint_table(cfg), param_specs(cfg, dtype),
                           decoder_expert_specs(cfg, dtype), put_row)
    return params, None
