"""DeepSeek-V4.1 (and its published checkpoints) as an engine family.

The model is tidejax.models.deepseek_v41; this module tells the engine how to load it (routed
experts into the residency pool, Engram tables kept in host memory), how big its cache is, and
how the host computes each step's Engram rows: the n-gram hashes depend only on token ids, so
one EngramHasher per lane (addressed by position) hashes the step's tokens and the rows are
gathered from the host tables before the step runs.
"""

from __future__ import annotations

import numpy as np

from tidejax.models import deepseek_v41_load
from tidejax.models.deepseek_v41 import DeepseekV41, V41Cache
from tidejax.models.deepseek_v41_config import V41Config
from tidejax.models.deepseek_v41_load import V41Checkpoint
from tidejax.models.engram import EngramHasher, gather_rows
from tidejax.models.registry import Family, register


def load_weights(cfg: V41Config, model_dir, raw_config: dict, serve, dtype, put_row):
    checkpoint = deepseek_v41_load.load(model_dir, dtype=dtype, put_row=put_row)
    return checkpoint.params["params"], checkpoint


def engram_rows(ck: V41Checkpoint, hashers: list[EngramHasher], tokens: np.ndarray,
                starts, token_mask: np.ndarray | None = None):
    """Host side of Engram: tokens [b, t] at positions starts[r].. -> float32
    [b, t, engram layers, cols, e] table rows (None for a model without Engram)."""
    if not ck.cfg.engram_layers:
        return None
    ids = np.stack([h(row, int(s), None if token_mask is None else token_mask[r])
                    for r, (h, row, s) in enumerate(zip(hashers, np.asarray(tokens), starts))])
    return gather_rows(ck.engram_tables, ids)


def new_hashers(ck: V41Checkpoint, batch: int) -> list[EngramHasher]:
    return [EngramHasher(ck.engram_layout) for _ in range(batch)] if ck.engram_layout else []


class EngramInputs:
    """The Engram rows of a step, from one hasher per row of the batch (a lane or a sequence)."""

    def __init__(self, checkpoint, batch: int):
        self.checkpoint = checkpoint
        self.hashers = new_hashers(checkpoint, batch)

    def rows(self, tokens: np.ndarray, starts, mask: np.ndarray, lanes=None):
        """tokens [b, t] at positions starts[r].. (mask: real tokens); lanes: which hasher serves
        each row (default: row r -> hasher r)."""
        hashers = self.hashers if lanes is None else [self.hashers[i] for i in lanes]
        return engram_rows(self.checkpoint, hashers, tokens, starts, mask)


def replay_variables(cfg: V41Config, ids) -> dict:
    """Recorded picks ids [b, t, layers, k] as the MoE layers' "replay" variables (every layer
    is a MoE layer)."""
    return {f"layers_{layer}": {"ffn": {"ids": ids[:, :, layer]}} for layer in range(cfg.num_layers)}


def host_inputs(cfg: V41Config, checkpoint, batch: int):
    return EngramInputs(checkpoint, batch) if cfg.engram_layers else None


register(Family(
    name="deepseek_v41",
    model_types=("deepseek_v41",),
    config_from_hf=V41Config.from_hf,
    build=lambda cfg, serve, dtype: DeepseekV41(cfg, serve, dtype),
    load_weights=load_weights,
    expert_dims=lambda cfg: (cfg.num_layers, cfg.n_routed_experts, cfg.hidden_size,
                             cfg.moe_intermediate_size),
    top_k=lambda cfg: cfg.num_experts_per_tok,
    cache_kind="lanes",
    create_cache=V41Cache.create,
    cache_bytes_per_token=V41Cache.bytes_per_token,
    replay_variables=replay_variables,
    host_inputs=host_inputs,
    swiglu_limit=lambda cfg: cfg.swiglu_limit,
))
