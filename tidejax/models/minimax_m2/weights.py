"""MiniMax-M2 params, declared, and the checkpoint table that fills them from the published layout
(layers/decoder.block_sparse_moe_table, with GQA's projections)."""

from __future__ import annotations

from tidejax.checkpoint import Table
from tidejax.models.layers.decoder import (block_sparse_moe_table, decoder_expert_specs,
                                           decoder_specs)
from tidejax.models.layers.gqa import GQA_RULES, gqa_specs
from tidejax.models.loading import load_by_table
from tidejax.models.minimax_m2.config import MiniMaxM2Config
from tidejax.models.minimax_m2.model import router_spec
from tidejax.residency.serve import ServeOptions


def param_specs(cfg: MiniMaxM2Config, dtype) -> dict:
    """The dense params (everything but the routed experts) as ParamSpecs."""
    return decoder_specs(cfg, router_spec(cfg), lambda layer: gqa_specs(cfg, dtype), dtype)


def expert_specs(cfg: MiniMaxM2Config, dtype) -> dict:
    """The routed experts as host-pool rows (moe layer * n_routed_experts + expert)."""
    return decoder_expert_specs(cfg, dtype)


def checkpoint_table(cfg: MiniMaxM2Config) -> Table:
    """Hugging Face tensor names -> the declared params and the routed-expert rows."""
    return block_sparse_moe_table(cfg, GQA_RULES)


def load_weights(cfg: MiniMaxM2Config, model_dir, raw_config: dict, serve: ServeOptions, dtype,
                 put_row):
    params = load_by_table(model_dir, raw_config, checkpoint_table(cfg), param_specs(cfg, dtype),
                           expert_specs(cfg, dtype), put_row)
    return params, None
