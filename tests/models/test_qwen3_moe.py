"""The Qwen3-MoE family's config and layouts on tiny random Qwen3MoeForCausalLM checkpoints (its
parity with transformers: test_family_contract.py)."""

from __future__ import annotations

import json

import pytest

import tidejax
from tidejax.errors import ConfigError
from tidejax.models.qwen3_moe.config import Qwen3MoeConfig
from tests.support.tiny_models import (QWEN3_MOE_CONFIGS, assert_same_weights, qwen3_moe_config,
                                       write_fused_copy, write_qwen3_moe)

@pytest.fixture(scope="module", params=sorted(QWEN3_MOE_CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = write_qwen3_moe(path, seed=len(request.param), **QWEN3_MOE_CONFIGS[request.param])
    return request.param, path, model, tidejax.load(path)


def test_config_reads_what_transformers_wrote(tiny):
    name, _, model, engine = tiny
    cfg, hf = engine.cfg, model.config
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.norm_topk_prob, cfg.rope.theta) == (
        hf.head_dim, hf.num_key_value_heads, hf.norm_topk_prob, 1e6)
    assert cfg.moe_layers == tuple(i for i in range(hf.num_hidden_layers)
                                   if i not in hf.mlp_only_layers)


def test_fused_experts_load_as_the_published_ones(tiny, tmp_path):
    """transformers 5's in-memory fused experts load as the per-expert tensors it saves."""
    name, path, model, engine = tiny
    if name != "renormalized":
        pytest.skip("one config is enough for the layouts")
    assert_same_weights(tidejax.load(write_fused_copy(model, path, tmp_path / "fused")), engine)


@pytest.mark.parametrize("field, value, message", [
    ("num_key_value_heads", 3, "num_key_value_heads.*divide"),
    ("attention_bias", True, "attention_bias"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("decoder_sparse_step", 0, "decoder_sparse_step"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_bad_config_fields_are_named(field, value, message):
    raw = json.loads(qwen3_moe_config().to_json_string())
    raw[field] = value
    with pytest.raises(ConfigError, match=f"config.json.*{message}"):
        Qwen3MoeConfig.from_hf(raw, "config.json")


def test_published_config_fields():
    """A config.json as Qwen publishes it: rope_theta at the top, decoder_sparse_step and
    mlp_only_layers naming which layers have a MoE."""
    raw = json.loads(qwen3_moe_config().to_json_string())
    del raw["rope_parameters"]
    raw.update(rope_theta=1e6, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    cfg = Qwen3MoeConfig.from_hf(raw)
    assert (cfg.rope.theta, cfg.rope.dim, cfg.moe_layers) == (1e6, 24, (1, 5))
