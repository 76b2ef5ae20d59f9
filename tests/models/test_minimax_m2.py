"""The MiniMax-M2 family's config on tiny random MiniMaxM2ForCausalLM configs (its parity with
transformers: test_family_contract.py)."""

from __future__ import annotations

import json

import pytest

from tidejax.errors import ConfigError
from tidejax.models.minimax_m2.config import MiniMaxM2Config
from tests.support.tiny_models import minimax_m2_config


def test_config_reads_what_transformers_wrote():
    cfg = MiniMaxM2Config.from_hf(json.loads(minimax_m2_config(0.5).to_json_string()))
    assert (cfg.head_dim, cfg.rotary_dim, cfg.num_kv_heads, cfg.n_routed_experts,
            cfg.moe_intermediate_size, cfg.rope.theta, cfg.qk_norm_span) == (
        24, 12, 2, 8, 32, 5e6, "projection")


@pytest.mark.parametrize("field, value, message", [
    ("num_key_value_heads", 3, "num_key_value_heads.*divide"),
    ("rotary_dim", 7, "rotary_dim"),
    ("scoring_func", "softmax", "scoring_func"),
    ("use_qk_norm", False, "use_qk_norm"),
    ("qk_norm_type", "per_head", "qk_norm_type"),
    ("use_routing_bias", False, "use_routing_bias"),
    ("num_experts_per_tok", 0, "num_experts_per_tok"),
])
def test_bad_config_fields_are_named(field, value, message):
    raw = json.loads(minimax_m2_config().to_json_string())
    if field == "rotary_dim":
        del raw["rope_parameters"]["partial_rotary_factor"]
    raw[field] = value
    with pytest.raises(ConfigError, match=f"config.json.*{message}"):
        MiniMaxM2Config.from_hf(raw, "config.json")


def test_published_config_fields():
    """A config.json as MiniMaxAI publishes it: rope_theta and the legacy rotary_dim at the top."""
    raw = json.loads(minimax_m2_config().to_json_string())
    del raw["rope_parameters"]
    raw.update(rope_theta=5e6, rotary_dim=8, use_qk_norm=True, qk_norm_type="per_layer",
               scoring_func="sigmoid", use_routing_bias=True)
    cfg = MiniMaxM2Config.from_hf(raw)
    assert (cfg.rope.theta, cfg.rotary_dim, cfg.rope.dim) == (5e6, 8, 8)
