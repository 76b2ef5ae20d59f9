"""The GLM-5 family against transformers' GlmMoeDsaForCausalLM on tiny random checkpoints: DSA
top-k below and above the context, with and without a dense layer, a "shared" indexer layer;
1, 2 and 8 index heads on prompts around top-k (tied scores picked as jax.lax.top_k picks
them); the published layouts (FP8 blocks, fused experts, the MTP layer kept); DSA's sparse
attention against numpy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import tidejax
from tidejax.checkpoint import CheckpointReader
from tidejax.errors import ConfigError
from tidejax.kv.paged import sparse_mla_attention
from tidejax.models.glm_moe_dsa.config import GlmMoeDsaConfig
from tidejax.models.glm_moe_dsa.weights import param_specs
from tidejax.models.layers.compress import top_k_select
from tidejax.runtime.client import tool_format_for
from tidejax.text.toolcalls import GLM
from tests.support.declaration import check_dense_dtypes
from tests.support.tiny_models import (GLM_MOE_DSA_CONFIGS, assert_same_weights,
                                       cached_decode_logits, glm_moe_dsa_config, load_mtp_copy,
                                       lower_index_ties, relative_diff, second_turn, served_greedy,
                                       transformers_greedy, write_fp8_copies, write_fused_copy,
                                       write_glm_moe_dsa)

PROMPT = np.random.RandomState(7).randint(3, 256, 32)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=sorted(GLM_MOE_DSA_CONFIGS))
def tiny(request, tiny_family):
    """(config name, path, transformers' model, the engine): tests/models/conftest.py's, shared
    with the family contract (test_family_contract.py: declared params, logits, greedy tokens,
    cached decode, half-resident `exact`)."""
    return request.param, *tiny_family("glm_moe_dsa", request.param)


# Index heads 1, 2 and 8 with an indexer in every layer, top-k 8, and prompts of top-k - 1,
# top-k, top-k + 1 and 2.5 top-k tokens. Pages of 4 tokens: a row of up to 8 tokens (two pages)
# attends all it holds, a longer one its pick, so the served tokens cross that switch too.
TIES_TOPK = 8
TIES_PROMPT = np.random.RandomState(11).randint(3, 256, 20)
TIES_LENGTHS = (7, 8, 9, 20)
TIES_ENGINE = {"page_size": 4, "lanes": 1, "max_context": 64, "prefill_chunk": 16}


@pytest.fixture(scope="module", params=(1, 2, 8), ids=lambda n: f"{n}heads")
def index_heads(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"index_heads_{request.param}")
    model = write_glm_moe_dsa(path, seed=request.param, index_n_heads=request.param,
                              index_topk=TIES_TOPK, index_topk_pattern="FF",
                              first_k_dense_replace=1, num_hidden_layers=2)
    return request.param, model, tidejax.load(path, engine=TIES_ENGINE)


def test_logits_match_transformers_around_topk(index_heads):
    """With 1 or 2 index heads the k-th place of the longest prompt's pick is a tie somewhere
    (the choice torch leaves open, lower_index_ties): the parity covers the tie rule."""
    heads, model, engine = index_heads
    for n in TIES_LENGTHS:
        with torch.no_grad(), lower_index_ties() as tied:
            ref = model(torch.tensor(TIES_PROMPT[:n])[None]).logits[0].numpy()
        assert relative_diff(engine.logits(TIES_PROMPT[:n]), ref) < 1e-4, n
    assert sum(tied) > 0 or heads == 8


def test_greedy_tokens_match_transformers_across_topk(index_heads):
    """From top-k - 1 prompt tokens on, the served decode steps cross from attending every
    entry to the pick."""
    heads, model, engine = index_heads
    if heads != 1:
        pytest.skip("one head ties the most; topk_below serves 8")
    prompt = TIES_PROMPT[:TIES_TOPK - 1]
    with lower_index_ties():
        want = transformers_greedy(model, prompt, 6)
    assert served_greedy(engine, prompt, 6) == want


def test_cached_decode_equals_full_forward_around_topk(index_heads):
    _, _, engine = index_heads
    stepped = cached_decode_logits(engine, TIES_PROMPT, TIES_TOPK - 1)
    assert relative_diff(stepped, engine.logits(TIES_PROMPT)) < 1e-5


def test_declared_params_keep_the_indexer_and_its_dtypes():
    """In the config with every kind of param (an indexer layer and a shared one, a dense layer,
    MoE layers; the contract checks the forward reads each and the table names each once): the
    indexer's params in the "full" layer only, and the dtypes of a bfloat16 model (float32
    routers and indexer weights, as transformers keeps them)."""
    raw = glm_moe_dsa_config(**GLM_MOE_DSA_CONFIGS["topk_below"]).to_dict()
    cfg = GlmMoeDsaConfig.from_hf(raw)
    assert (cfg.index_layers, cfg.moe_layers) == ((0,), (1,))
    declared = param_specs(cfg, jnp.float32)
    assert ["indexer" in declared[f"layers_{i}"]["attn"] for i in (0, 1)] == [True, False]
    check_dense_dtypes(param_specs(cfg, jnp.bfloat16),
                       lambda path: path[-2:-1] in (("moe",), ("weights_proj",)))


def test_the_selection_changes_the_reference(tiny):
    """Below the context the indexer's top-k changes transformers' own logits, so the parity
    above checks the selection, not only MLA."""
    name, _, model, _ = tiny
    if name != "topk_below":
        pytest.skip("the selection is everything above the context")
    with torch.no_grad(), lower_index_ties():
        ref = model(torch.tensor(PROMPT)[None]).logits[0].numpy()
        for layer in model.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.index_topk = len(PROMPT)
        dense = model(torch.tensor(PROMPT)[None]).logits[0].numpy()
        for layer in model.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.index_topk = model.config.index_topk
    assert relative_diff(dense, ref) > 1e-2


def test_a_second_turn_shares_the_first_turns_pages(tiny):
    """Pages of 64: turn 1 (70 tokens, 8 generated) writes one full page of MLA latents and the indexer keys; turn 2
    (88 tokens) shares it, prefills the other 24 and answers as transformers does."""
    _, _, model, engine = tiny
    first = np.random.RandomState(8).randint(3, 256, 70).tolist()
    prompt, tokens, cached, prefilled = second_turn(engine, first, list(range(20, 30)), 8)
    assert (cached, prefilled) == (64, len(prompt) - 64)
    assert tokens == transformers_greedy(model, prompt, 8)

def test_layouts_load_the_same_weights(tiny, tmp_path):
    """transformers 5's fused experts load as the published per-expert tensors do, and the FP8
    blocks as published as their dequantized values."""
    name, path, model, engine = tiny
    if name != "topk_below":
        pytest.skip("one config is enough for the layouts")
    assert_same_weights(tidejax.load(write_fused_copy(model, path, tmp_path / "fused")), engine)
    fp8, dequant = write_fp8_copies(path, tmp_path)
    assert CheckpointReader(fp8, progress=False).tensors[
        "model.layers.0.self_attn.q_b_proj.weight"].format == "fp8"
    assert_same_weights(tidejax.load(fp8), tidejax.load(dequant))


def test_mtp_layer_is_loaded_and_kept(tiny, tmp_path):
    """The published MTP layer after the last decoder layer (a DSA layer with its indexer and
    its own routed experts, plus enorm, hnorm, eh_proj and shared_head.norm) is read into host
    arrays as stored, apart from the decoder's params."""
    name, path, model, engine = tiny
    if name != "topk_below":
        pytest.skip("one config is enough for the MTP layer")
    # a DSA layer with an indexer (layer 0's attention) and a MoE (layer 1's), published names
    load_mtp_copy("glm_moe_dsa", path, engine, tmp_path / "mtp", {
        "eh_proj.weight": ("eh_proj", "weight"),
        "self_attn.indexer.wk.weight": ("attn", "indexer", "wk", "weight"),
        "mlp.experts.5.down_proj.weight": ("moe", "experts", "5", "down_proj")})


def test_sparse_mla_attention_reads_only_the_picked_entries():
    """Against float64 numpy: each query attends its picked entries, on shuffled pages of 4;
    every entry nobody picked holds NaN, which would reach the output if read; a query with no
    valid pick gets zeros. 70 queries: two blocks of QUERY_BLOCK."""
    rng = np.random.RandomState(0)
    b, t, h, c, r, k, ps, n_pages = 2, 70, 3, 8, 4, 5, 4, 12
    latent = rng.randn(n_pages, ps, c).astype(np.float32)
    rope = rng.randn(n_pages, ps, r).astype(np.float32)
    table = np.stack([rng.permutation(n_pages)[:6] for _ in range(b)]).astype(np.int32)
    ids = rng.randint(0, 6 * ps, (b, t, k)).astype(np.int32)
    valid = rng.rand(b, t, k) < 0.7
    valid[0, 3] = False
    picked = np.zeros((n_pages, ps), bool)
    for row in range(b):
        for g in ids[row][valid[row]]:
            picked[table[row, g // ps], g % ps] = True
    latent[~picked], rope[~picked] = np.nan, np.nan
    q_latent = rng.randn(b, t, h, c).astype(np.float32)
    q_rope = rng.randn(b, t, h, r).astype(np.float32)
    out = np.asarray(sparse_mla_attention(*map(jnp.asarray, (q_latent, q_rope, latent, rope,
                                                             table, ids, valid)), scale=0.4))
    for row in range(b):
        for i in range(t):
            g = ids[row, i][valid[row, i]]
            if not len(g):
                np.testing.assert_array_equal(out[row, i], 0)
                continue
            lat = latent[table[row, g // ps], g % ps].astype(np.float64)
            rot = rope[table[row, g // ps], g % ps].astype(np.float64)
            scores = (q_latent[row, i] @ lat.T + q_rope[row, i] @ rot.T) * 0.4  # [h, picks]
            p = np.exp(scores - scores.max(-1, keepdims=True))
            want = (p / p.sum(-1, keepdims=True)) @ lat
            np.testing.assert_allclose(out[row, i], want, rtol=1e-5, atol=1e-6)


def test_top_k_select_gives_ties_to_the_lower_id():
    """Equal scores, +0.0 and -0.0 among them (equal, though top_k's total order ranks -0.0
    lower), go to the lower id; -inf picks are not valid. Also at GLM-5's top-k (2,048 of
    4,096, most scores 0.0 or -0.0) against numpy's stable sort."""
    scores = jnp.array([[-0.0, 0.5, 0.0, -0.0, -1.0, 0.0],
                        [-jnp.inf, 2.0, 2.0, -jnp.inf, 2.0, -jnp.inf]])
    ids, valid = top_k_select(scores, 4)
    np.testing.assert_array_equal(ids, [[1, 0, 2, 3], [1, 2, 4, 0]])
    np.testing.assert_array_equal(valid, [[True] * 4, [True, True, True, False]])
    rng = np.random.RandomState(0)
    scores = rng.randn(4, 4096).astype(np.float32)
    zero = rng.rand(4, 4096) < 0.7
    scores[zero] = 0.0
    scores[zero & (rng.rand(4, 4096) < 0.5)] = -0.0
    ids, _ = top_k_select(jnp.asarray(scores), 2048)
    np.testing.assert_array_equal(ids, np.argsort(-scores, axis=-1, kind="stable")[:, :2048])


def test_synthetic_glm5_checkpoint_loads_and_decodes(tmp_path):
    """tools/make_synthetic.py's GLM-5 shapes: the config.json transformers writes, the published
    tensor names (MLA and the indexer), the shape's own dense layer, MXFP4 experts."""
    out = tmp_path / "glm5"
    subprocess.run([sys.executable, "-m", "tools.make_synthetic", str(out),
                    "--shape", "glm5-tiny", "--layers", "2", "--workers", "1"],
                   cwd=REPO, check=True, capture_output=True)
    engine = tidejax.load(out, engine={"lanes": 1, "max_context": 64},
                          model={"experts": "checkpoint"})
    assert (engine.cfg.index_layers, engine.cfg.moe_layers, engine.cfg.index_topk) == (
        (0, 1), (1,), 16)
    logits = engine.logits(engine.tokenizer.encode("The tide comes in and the tide goes out."))
    assert np.isfinite(logits).all() and 0.3 < logits.std() < 3  # unit-scale activations


@pytest.mark.parametrize("field, value, message", [
    ("indexer_types", ["shared", "full", "full"], "indexer_types.*starts with a shared"),
    ("mlp_layer_types", ["dense", "moe", "sparse"], "mlp_layer_types"),
    ("rope_interleave", False, "rope_interleave"),
    ("attention_bias", True, "attention_bias"),
    ("n_group", 3, "n_group"),
])
def test_bad_config_fields_are_named(field, value, message):
    raw = glm_moe_dsa_config(num_hidden_layers=3).to_dict() | {field: value}
    with pytest.raises(ConfigError, match=f"config.json.*{message}"):
        GlmMoeDsaConfig.from_hf(raw, "config.json")


def test_published_config_fields():
    """A config.json as zai-org publishes GLM-5's: indexer_types every 4th layer "full" after
    the first 3 (transformers' index_topk_freq / index_skip_topk_offset without the list),
    the MTP layer, rope_interleave; GLM's tool-call format."""
    raw = glm_moe_dsa_config(num_hidden_layers=10).to_dict()
    del raw["indexer_types"], raw["mlp_layer_types"]
    raw |= {"index_topk_freq": 4, "index_skip_topk_offset": 3, "num_nextn_predict_layers": 1,
            "rope_interleave": True, "indexer_rope_interleave": True, "first_k_dense_replace": 3}
    cfg = GlmMoeDsaConfig.from_hf(raw)
    assert cfg.index_layers == (0, 1, 2, 6, 10)  # and the MTP layer's own indexer
    assert (cfg.moe_layers, cfg.num_mtp_layers) == (tuple(range(3, 10)), 1)
    assert tool_format_for("glm_moe_dsa", "") is GLM
