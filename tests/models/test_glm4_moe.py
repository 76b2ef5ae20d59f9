"""The GLM-4.5 family against transformers' Glm4MoeForCausalLM on tiny random checkpoints; GLM's
tool-call parser on fixed replies, and a call served with thinking off. Its published template is
a chat family's (tests/support/chat_models.py): rendered against transformers with thinking on
and off in tests/server/test_chat_formats.py, its call and result with thinking on served to the
openai and anthropic clients in tests/models/test_family_contract.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

import tidejax
from tidejax.errors import ConfigError
from tidejax.kv.paged import gqa_attention
from tidejax.models.glm4_moe.config import Glm4MoeConfig
from tidejax.models.glm4_moe.weights import load_weights
from tidejax.models.layers.mtp import mtp_expert_state, mtp_params
from tidejax.models.loading import ExpertPool
from tidejax.residency.serve import ServeOptions
from tidejax.text.toolcalls import GLM, OutputParser
from tests.support.chat_models import CITY, WEATHER
from tests.support.tiny_models import (GLM4_MOE_CONFIGS, assert_same_weights, glm4_moe_config,
                                       load_mtp_copy, second_turn, transformers_greedy,
                                       write_fp8_copies, write_fused_copy)

PROMPT = np.random.RandomState(7).randint(3, 256, 32)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=sorted(GLM4_MOE_CONFIGS))
def tiny(request, tiny_family):
    """(config name, path, transformers' model, the engine): tests/models/conftest.py's, shared
    with the family contract (test_family_contract.py: declared params, logits, greedy tokens,
    cached decode, on the paged GQA kernel too, half-resident `exact`)."""
    return request.param, *tiny_family("glm4_moe", request.param)


def test_config_reads_what_transformers_wrote(tiny):
    name, _, model, engine = tiny
    cfg, hf = engine.cfg, model.config
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.use_qk_norm, cfg.attention_bias) == (
        hf.head_dim, hf.num_key_value_heads, hf.use_qk_norm, hf.attention_bias)
    assert cfg.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert len(cfg.moe_layers) == hf.num_hidden_layers - hf.first_k_dense_replace


def test_a_second_turn_shares_the_first_turns_pages(tiny):
    """Pages of 64: turn 1 (70 tokens, 8 generated) writes one full page of GQA keys and values;
    turn 2 (88 tokens) shares it, prefills the other 24 and answers as transformers does."""
    _, _, model, engine = tiny
    first = np.random.RandomState(8).randint(3, 256, 70).tolist()
    prompt, tokens, cached, prefilled = second_turn(engine, first, list(range(20, 30)), 8)
    assert (cached, prefilled) == (64, len(prompt) - 64)
    assert tokens == transformers_greedy(model, prompt, 8)


def test_layouts_load_the_same_weights(tiny, tmp_path):
    """transformers 5's in-memory fused experts load as the published per-expert tensors do;
    the FP8 blocks as published load as their dequantized values."""
    name, path, model, engine = tiny
    if name != "qknorm_groups":
        pytest.skip("one config is enough for the layouts")
    fused = write_fused_copy(model, path, tmp_path / "fused")
    assert_same_weights(tidejax.load(fused), engine)
    fp8, dequant = write_fp8_copies(path, tmp_path)
    loaded = tidejax.load(fp8)
    assert_same_weights(loaded, tidejax.load(dequant))
    params = loaded.loaded.params["layers_1"]
    assert not np.array_equal(params["attn"]["q_proj"]["weight"],
                              engine.loaded.params["layers_1"]["attn"]["q_proj"]["weight"])


def test_mtp_layer_is_loaded_and_kept(tiny, tmp_path):
    """The published MTP layer after the last decoder layer (a GQA layer with its q/k norm and
    biases, its own routed experts, enorm, hnorm, eh_proj and shared_head.norm; its copies of
    the embedding and the head read past) is read into host arrays as stored, apart from the
    decoder's params."""
    name, path, model, engine = tiny
    if name != "qknorm_groups":
        pytest.skip("one config is enough for the MTP layer")
    out = tmp_path / "mtp"
    cfg, raw, mtp, _, n = load_mtp_copy("glm4_moe", path, engine, out, {
        "eh_proj.weight": ("eh_proj", "weight"),
        "self_attn.k_norm.weight": ("attn", "k_norm", "weight"),
        "self_attn.q_proj.bias": ("attn", "q_proj", "bias"),
        "mlp.experts.5.down_proj.weight": ("moe", "experts", "5", "down_proj")})

    # published FP8 (GLM-4.5-FP8): the MTP layer is kept FP8 on the host; the draft forward's
    # params and experts are its dequantized values, those of the float copy of the same values
    drafts, kepts = [], []
    for copy in write_fp8_copies(out, tmp_path):
        pool = ExpertPool(len(cfg.moe_layers) * cfg.n_routed_experts, "checkpoint", np.float32)
        params, kept = load_weights(cfg, copy, raw, ServeOptions(), jnp.float32, pool.put_row)
        kepts.append(kept[f"layers_{n}"])
        drafts.append((mtp_params(params, kept, cfg, jnp.float32),
                       mtp_expert_state(kept, cfg, jnp.float32).bank))
    values, scales = kepts[0]["moe"]["experts"]["5"]["down_proj"]  # FP8 as stored
    assert values.dtype == jnp.float8_e4m3fn and scales.dtype == np.float32
    assert not np.array_equal(drafts[0][0][f"layers_{n}"]["eh_proj"]["weight"],
                              mtp[f"model.layers.{n}.eh_proj.weight"])  # FP8's rounding
    assert jax.tree.structure(drafts[0]) == jax.tree.structure(drafts[1])
    for u, v in zip(jax.tree.leaves(drafts[0]), jax.tree.leaves(drafts[1])):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("field, value, message", [
    ("num_key_value_heads", 3, "num_key_value_heads.*divide"),
    ("partial_rotary_factor", 0.01, "partial_rotary_factor"),
    ("n_group", 3, "n_group"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_bad_config_fields_are_named(field, value, message):
    raw = json.loads(glm4_moe_config().to_json_string())
    if field == "partial_rotary_factor":
        raw["rope_parameters"][field] = value
    else:
        raw[field] = value
    with pytest.raises(ConfigError, match=f"config.json.*{message}"):
        Glm4MoeConfig.from_hf(raw, "config.json")


def test_published_config_fields():
    """A config.json as zai-org publishes it: rope_theta and partial_rotary_factor at the top."""
    raw = json.loads(glm4_moe_config().to_json_string())
    del raw["rope_parameters"]
    raw.update(rope_theta=1e6, partial_rotary_factor=0.25)
    cfg = Glm4MoeConfig.from_hf(raw)
    assert (cfg.rotary_dim, cfg.rope.theta, cfg.rope.dim) == (6, 1e6, 6)


def test_gqa_attention_reads_only_the_rows_pages():
    """Against float64 numpy: rows of different lengths over shuffled pages of 4, each KV head
    serving two query heads; every pool page outside the rows' tables, and the table's pages
    past the key block of the last position, hold NaN, which would reach the output if read."""
    rng = np.random.RandomState(0)
    b, t, h, g, k, ps = 2, 3, 4, 2, 8, 4
    n_pages = 140
    k_pages = np.full((n_pages, ps, g, k), np.nan, np.float32)
    v_pages = k_pages.copy()
    lengths = [9, 5]  # positions 0..len-1; the chunk's 3 queries are the last 3
    held = rng.permutation(12)
    for p in held[:6]:
        k_pages[p], v_pages[p] = rng.randn(ps, g, k), rng.randn(ps, g, k)
    table = np.full((b, 130), held[5], np.int32)  # padding: a page past each row's length
    table[:, 128:] = 139  # table pages 128..: past the key block of the last position
    table[0, :3], table[1, :2] = held[:3], held[3:5]
    positions = np.array([[n - 3 + i for i in range(t)] for n in lengths], np.int32)
    q = rng.randn(b, t, h, k).astype(np.float32)
    out = np.asarray(gqa_attention(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages),
                                   jnp.asarray(table), jnp.asarray(positions), scale=0.3))
    for row in range(b):
        keys = k_pages[table[row, :3]].reshape(-1, g, k).astype(np.float64)
        values = v_pages[table[row, :3]].reshape(-1, g, k).astype(np.float64)
        for i in range(t):
            n = positions[row, i] + 1
            for head in range(h):
                scores = keys[:n, head // 2] @ q[row, i, head] * 0.3
                p = np.exp(scores - scores.max())
                want = p @ values[:n, head // 2] / p.sum()
                np.testing.assert_allclose(out[row, i, head], want, rtol=1e-5, atol=1e-6)


def test_synthetic_glm_checkpoint_loads_and_decodes(tmp_path):
    """tools/make_synthetic.py's GLM shapes: the published config.json and tensor names, the
    shape's own dense layers, MXFP4 experts kept as MXFP4 in the bank."""
    out = tmp_path / "glm"
    subprocess.run([sys.executable, "-m", "tools.make_synthetic", str(out),
                    "--shape", "glm-tiny", "--layers", "3", "--workers", "1"],
                   cwd=REPO, check=True, capture_output=True)
    raw = json.loads((out / "config.json").read_text())
    assert (raw["model_type"], raw["first_k_dense_replace"], raw["partial_rotary_factor"]) == (
        "glm4_moe", 1, 0.5)
    engine = tidejax.load(out, engine={"lanes": 1, "max_context": 64},
                          model={"experts": "checkpoint"})
    assert (engine.cfg.rotary_dim, engine.cfg.moe_layers) == (8, (1, 2))
    assert set(engine.state.experts.bank) == {"gate_up_blocks", "gate_up_scales", "down_blocks",
                                              "down_scales"}
    logits = engine.logits(engine.tokenizer.encode("The tide comes in"))
    assert np.isfinite(logits).all() and 0.3 < logits.std() < 3  # unit-scale activations


# ---- GLM's tool calls ---------------------------------------------------------------------------

@pytest.mark.parametrize("chunks", [1, 4, 1000])
def test_parser_reads_glm_calls(chunks):
    """Two calls; a string argument that looks like a number stays a string where the tool's
    schema says string, and becomes JSON where it does not."""
    text = ("<think>user wants weather</think>Let me look.<tool_call>get_weather\n"
            "<arg_key>city</arg_key>\n<arg_value>1984</arg_value>\n<arg_key>days</arg_key>\n"
            "<arg_value>3</arg_value>\n</tool_call><tool_call>lookup\n<arg_key>q</arg_key>\n"
            '<arg_value>{"a": [1, 2]}</arg_value>\n<arg_key>note</arg_key>\n'
            "<arg_value>multi\nline</arg_value>\n</tool_call>")
    parser = OutputParser(GLM, tools=[WEATHER])
    pieces = [p for i in range(0, len(text), chunks) for p in parser.feed(text[i:i + chunks])]
    pieces += parser.finish()
    assert "".join(t for kind, t in pieces if kind == "reasoning") == "user wants weather"
    assert "".join(t for kind, t in pieces if kind == "content") == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == [
        ("get_weather", {"city": "1984", "days": 3}),
        ("lookup", {"q": {"a": [1, 2]}, "note": "multi\nline"})]


def test_parser_keeps_a_broken_glm_call_as_content():
    for bad in ("<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
                "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</tool_call>"):
        parser = OutputParser(GLM, tools=[WEATHER])
        out = parser.feed(bad) + parser.finish()
        assert parser.tool_calls == [] and "".join(t for _, t in out) == bad


def test_served_call_with_thinking_off(chat_server):
    """enable_thinking = false: the prompt ends in <think></think>, the model writes the call
    straight away, and it comes back to the openai client with no reasoning_content (the
    contract serves thinking on)."""
    _, url, engine = chat_server("glm4_moe")
    oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    choice = oai.chat.completions.create(
        model=engine.served_name, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER], temperature=0, max_tokens=24,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert (choice.message.model_extra or {}).get("reasoning_content") is None
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("get_weather", {"city": CITY})]
