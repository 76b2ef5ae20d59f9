"""The Mixtral family's config on tiny random MixtralForCausalLM checkpoints (its parity with
transformers: test_family_contract.py)."""

from __future__ import annotations

import json

import pytest

from tidejax.errors import ConfigError
from tidejax.models.mixtral.config import MixtralConfig
from tests.support.tiny_models import mixtral_config


def test_config_reads_what_transformers_wrote():
    hf = mixtral_config(num_experts_per_tok=3, num_key_value_heads=1)
    cfg = MixtralConfig.from_hf(json.loads(hf.to_json_string()))
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.n_routed_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, cfg.rope.theta) == (24, 1, 8, 3, 32, 1e6)
    assert cfg.moe_layers == (0, 1)


@pytest.mark.parametrize("field, value, message", [
    ("num_key_value_heads", 3, "num_key_value_heads.*divide"),
    ("sliding_window", 4096, "sliding_window"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_bad_config_fields_are_named(field, value, message):
    raw = json.loads(mixtral_config().to_json_string())
    raw[field] = value
    with pytest.raises(ConfigError, match=f"config.json.*{message}"):
        MixtralConfig.from_hf(raw, "config.json")


def test_published_config_fields():
    """A config.json as Mistral AI publishes it: rope_theta at the top, no head_dim."""
    raw = json.loads(mixtral_config().to_json_string())
    del raw["rope_parameters"], raw["head_dim"]
    raw.update(rope_theta=1e6)
    cfg = MixtralConfig.from_hf(raw)
    assert (cfg.rope.theta, cfg.head_dim, cfg.rope.dim) == (1e6, 16, 16)
