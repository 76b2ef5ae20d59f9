"""The Qwen3-MoE family against transformers' Qwen3MoeForCausalLM on tiny random checkpoints."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import tidejax
from tidejax.errors import ConfigError
from tidejax.kv.paged import PagedCache
from tidejax.models.layers.gqa import GQAPages
from tidejax.models.layers.decoder import decoder_expert_specs
from tidejax.models.qwen3_moe.config import Qwen3MoeConfig
from tidejax.models.qwen3_moe.model import build
from tidejax.models.qwen3_moe.weights import checkpoint_table, param_specs
from tidejax.residency.serve import ServeOptions
from tests.support.declaration import check_forward_on_declared, param_paths
from tests.support.tiny_models import (QWEN3_MOE_CONFIGS, assert_same_weights,
                                       cached_decode_logits, qwen3_moe_config, relative_diff,
                                       served_greedy, transformers_greedy, write_fused_copy,
                                       write_qwen3_moe)

PROMPT = np.random.RandomState(11).randint(3, 256, 32)


@pytest.fixture(scope="module", params=sorted(QWEN3_MOE_CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = write_qwen3_moe(path, seed=len(request.param), **QWEN3_MOE_CONFIGS[request.param])
    return request.param, path, model, tidejax.load(path)


def test_declared_params_are_what_the_model_consumes():
    """In the config with a dense layer beside a MoE layer."""
    cfg = Qwen3MoeConfig.from_hf(qwen3_moe_config(**QWEN3_MOE_CONFIGS["dense_first"]).to_dict())
    tokens = jnp.zeros((1, 4), jnp.int32)
    serve = ServeOptions(kernel="reference", all_resident=True)
    declared = param_specs(cfg, jnp.float32)
    check_forward_on_declared(
        build(cfg, serve, jnp.float32), declared, decoder_expert_specs(cfg, jnp.float32),
        len(cfg.moe_layers),
        (tokens, tokens, tokens > -1, PagedCache(GQAPages.create(cfg, 1, 4, jnp.float32)),
         tokens[:, :1]))
    table = checkpoint_table(cfg)
    for path in param_paths(declared):
        assert len(table.param_names(path)) == 1, path


def test_config_reads_what_transformers_wrote(tiny):
    name, _, model, engine = tiny
    cfg, hf = engine.cfg, model.config
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.norm_topk_prob, cfg.rope.theta) == (
        hf.head_dim, hf.num_key_value_heads, hf.norm_topk_prob, 1e6)
    assert cfg.moe_layers == tuple(i for i in range(hf.num_hidden_layers)
                                   if i not in hf.mlp_only_layers)


def test_logits_match_transformers(tiny):
    name, _, model, engine = tiny
    with torch.no_grad():
        ref = model(torch.tensor(PROMPT)[None]).logits[0].numpy()
    diff = relative_diff(engine.logits(PROMPT), ref)
    print(f"{name}: max relative logit difference {diff:.2e}")
    assert diff < 1e-4


def test_greedy_tokens_match_transformers(tiny):
    _, _, model, engine = tiny
    assert served_greedy(engine, PROMPT, 16) == transformers_greedy(model, PROMPT, 16)


def test_cached_decode_equals_full_forward(tiny):
    _, _, _, engine = tiny
    assert relative_diff(cached_decode_logits(engine, PROMPT, 16), engine.logits(PROMPT)) < 1e-5


def test_fused_experts_load_as_the_published_ones(tiny, tmp_path):
    """transformers 5's in-memory fused experts load as the per-expert tensors it saves."""
    name, path, model, engine = tiny
    if name != "renormalized":
        pytest.skip("one config is enough for the layouts")
    assert_same_weights(tidejax.load(write_fused_copy(model, path, tmp_path / "fused")), engine)


def test_half_resident_exact_equals_all_resident(tiny):
    name, path, _, engine = tiny
    if name != "renormalized":
        pytest.skip("one config is enough for residency: the one with two MoE layers")
    n_moe, n_experts = engine.family.expert_dims(engine.cfg)[:2]
    half = tidejax.load(path, residency={"budget_experts": n_moe * n_experts // 2,
                                         "miss_policy": "exact"})
    assert half.residency.stats()["resident"] == n_moe * n_experts // 2
    np.testing.assert_array_equal(half.logits(PROMPT), engine.logits(PROMPT))
    assert half.residency.stats()["misses"] > 0


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
