"""The GLM-4.5 family against transformers' Glm4MoeForCausalLM on tiny random checkpoints; GLM's
chat template, thinking switch and tool-call format end to end through the app and the openai
client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import torch
from safetensors.numpy import save_file

import tidejax
from tidejax.config import EngineConfig
from tidejax.errors import ConfigError
from tidejax.kv.paged import gqa_attention
from tidejax.models.glm4_moe.config import Glm4MoeConfig
from tidejax.models.glm4_moe.weights import load_weights
from tidejax.models.layers.mtp import mtp_expert_state, mtp_params
from tidejax.models.loading import ExpertPool
from tidejax.residency.serve import ServeOptions
from tidejax.runtime.client import LocalEngineClient, tool_format_for
from tidejax.server.app import Server
from tidejax.text.toolcalls import GLM, OutputParser
from tests.support.server_fixtures import serve_app, write_chain
from tests.support.tiny_models import (GLM4_MOE_CONFIGS, TEXT, assert_same_weights,
                                       glm4_moe_config, randomize_moe, second_turn, state_dict,
                                       transformers_greedy, write_fp8_copies, write_fused_copy,
                                       write_mtp_copy)

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
    """Pages of 64: turn 1 (70 tokens, 8 generated) writes one full page of GQA keys and values; turn 2
    (88 tokens) shares it, prefills the other 24 and answers as transformers does."""
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
    mtp = write_mtp_copy(path, out, attention_from=0, moe_from=1)
    n = model.config.num_hidden_layers
    raw = json.loads((out / "config.json").read_text())
    cfg = Glm4MoeConfig.from_hf(raw)
    pool = ExpertPool(len(cfg.moe_layers) * cfg.n_routed_experts, "checkpoint", np.float32)
    params, kept = load_weights(cfg, out, raw, ServeOptions(), jnp.float32, pool.put_row)
    layer = kept[f"layers_{n}"]
    for name, got in ((f"model.layers.{n}.eh_proj.weight", layer["eh_proj"]["weight"]),
                      (f"model.layers.{n}.self_attn.k_norm.weight",
                       layer["attn"]["k_norm"]["weight"]),
                      (f"model.layers.{n}.self_attn.q_proj.bias", layer["attn"]["q_proj"]["bias"]),
                      (f"model.layers.{n}.mlp.experts.5.down_proj.weight",
                       layer["moe"]["experts"]["5"]["down_proj"])):
        assert isinstance(got, np.ndarray) and not isinstance(got, jax.Array)
        np.testing.assert_array_equal(got, mtp[name])
    # the decoder's params are the engine's (so are its logits): the MTP layer stays apart
    assert jax.tree.structure(params) == jax.tree.structure(engine.loaded.params)
    for u, v in zip(jax.tree.leaves(params), jax.tree.leaves(engine.loaded.params)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))

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


# ---- GLM's chat template, thinking switch and tool calls -----------------------------------------

# GLM-4.5's control tokens (special in its tokenizer.json); eos: <|endoftext|>, <|user|>,
# <|observation|> (config.json's eos_token_id)
GLM_SPECIAL = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
               "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>",
               "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
               "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink"]
THOUGHT, CITY = "Checking the weather.", "Paris"
# with thinking on the prompt ends in <|assistant|>; with it off in <|assistant|>\n<think></think>:
# either way the model writes a call of get_weather(city=Paris), then <|observation|>
CHAIN = ["<|assistant|>", "<think>", THOUGHT, "</think>", "<tool_call>", "get_weather",
         "<arg_key>", "city", "</arg_key>", "<arg_value>", CITY, "</arg_value>", "</tool_call>",
         "<|observation|>"]
# the published chat_template.jinja of GLM-4.5 / 4.6 (its shape: the tools system turn, the
# /nothink switch, <think> blocks kept only after the last user turn, the XML argument format,
# tool results as <|observation|> turns)
GLM_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
<arg_key>{arg-key-2}</arg_key>
<arg_value>{arg-value-2}</arg_value>
...
</tool_call>{%- endif -%}
{%- macro visible_text(content) -%}
    {%- if content is string -%}
        {{- content }}
    {%- elif content is iterable and content is not mapping -%}
        {%- for item in content -%}
            {%- if item is mapping and item.type == 'text' -%}
                {{- item.text }}
            {%- elif item is string -%}
                {{- item }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- content }}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user_index=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {% set ns.last_user_index = loop.index0 -%}
    {%- endif %}
{%- endfor %}
{% for m in messages %}
{%- if m.role == 'user' -%}<|user|>
{{ visible_text(m.content) }}
{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not visible_text(m.content).endswith("/nothink")) else '' -}}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set reasoning_content = '' %}
{%- set content = visible_text(m.content) %}
{%- if m.reasoning_content is string %}
    {%- set reasoning_content = m.reasoning_content %}
{%- else %}
    {%- if '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
{%- endif %}
{%- if loop.index0 > ns.last_user_index and reasoning_content -%}
{{ '\\n<think>' + reasoning_content.strip() +  '</think>'}}
{%- else -%}
{{ '\\n<think></think>' }}
{%- endif -%}
{%- if content.strip() -%}
{{ '\\n' + content.strip() }}
{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
{%- if m.content is string -%}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' }}
{%- endif %}
{{- '\\n<tool_response>\\n' }}
{{- m.content }}
{{- '\\n</tool_response>' }}
{%- else -%}
<|observation|>{% for tr in m.content %}

<tool_response>
{{ tr.output if tr.output is defined else tr }}
</tool_response>{% endfor -%}
{% endif -%}
{%- elif m.role == 'system' -%}
<|system|>
{{ visible_text(m.content) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant|>{{- '\\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}
{%- endif -%}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}


def write_glm_tokenizer(path) -> dict[str, int]:
    """A byte-level BPE with GLM's control tokens (special) and the chain's text pieces as
    whole tokens (plain added tokens: only the model writes them), GLM's template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=GLM_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # trained on the template's tools turn too, so that a chat prompt is ~100 tokens
    tok.train_from_iterator([TEXT + (GLM_TEMPLATE + json.dumps(WEATHER)) * 4], trainer)
    tok.add_tokens([AddedToken(t, normalized=False) for t in (THOUGHT, "get_weather", "city", CITY)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": GLM_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}))
    return {t: tok.token_to_id(t) for t in GLM_SPECIAL + [THOUGHT, "get_weather", "city", CITY]}


@pytest.fixture(scope="module")
def glm_chat(tmp_path_factory):
    """A tiny GLM checkpoint whose weights write CHAIN (server_fixtures.write_chain), and an
    engine over it."""
    from transformers import Glm4MoeForCausalLM
    path = tmp_path_factory.mktemp("glm_chat")
    ids = write_glm_tokenizer(path)
    config = glm4_moe_config(
        **GLM4_MOE_CONFIGS["qknorm_groups"], vocab_size=max(ids.values()) + 1,
        num_hidden_layers=2, max_position_embeddings=1024, bos_token_id=None,
        eos_token_id=[ids[t] for t in ("<|endoftext|>", "<|user|>", "<|observation|>")])
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(config).eval()
    randomize_moe(model)
    write_chain(model, [ids[t] for t in CHAIN])
    model.save_pretrained(path)
    # prompt chunks of 16: one prefill bucket, so few step shapes to compile; warmup off:
    # client.start() leaves each shape to the first request that meets it
    return path, tidejax.load(path, engine={"lanes": 2, "max_context": 512, "prefill_chunk": 16,
                                            "warmup": False})


def test_template_switches_thinking(glm_chat):
    _, engine = glm_chat
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    _, on = engine.tokenizer.chat_prompt(messages, tools=[WEATHER])
    _, off = engine.tokenizer.chat_prompt(messages, tools=[WEATHER], enable_thinking=False)
    assert on.startswith("[gMASK]<sop><|system|>\n# Tools") and on.endswith("<|assistant|>")
    assert off.endswith("Weather in Paris?/nothink<|assistant|>\n<think></think>")
    assert tool_format_for("glm4_moe", GLM_TEMPLATE) is GLM


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


def test_served_tool_call_and_result(glm_chat):
    """The app over the engine and the openai client, thinking on and off: GLM's call comes
    back as an OpenAI tool call (its control tokens reach the parser although they are special
    tokens), the reasoning as reasoning_content only with thinking on, and the call's history and
    the tool's result render into the next prompt as GLM's template writes them."""
    path, engine = glm_chat
    client = LocalEngineClient(engine)
    assert client.info.tool_format is GLM
    asyncio.run(client.start())
    server = Server(EngineConfig().with_overrides({"model": {"path": str(path)}}))
    server.attach(client)
    try:
        with serve_app(server) as url:
            oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            for thinking in (True, False):
                check_tool_round_trip(oai, engine, thinking)
    finally:
        client.stop()


def check_tool_round_trip(oai, engine, thinking: bool) -> None:
    kwargs = dict(model=engine.served_name, tools=[WEATHER], temperature=0, max_tokens=24,
                  extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    choice = oai.chat.completions.create(messages=messages, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": CITY})
    assert getattr(choice.message, "reasoning_content", None) == (THOUGHT if thinking else None)
    history = messages + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    # the template reads the arguments as a mapping: the server hands them to it as one
    rendered = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if "tool_calls" in m else m
        for m in history]
    _, text = engine.tokenizer.chat_prompt(rendered, tools=[WEATHER], enable_thinking=thinking)
    assert text.endswith(
        f"<|assistant|>\n<think>{THOUGHT if thinking else ''}</think>\n"
        f"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{CITY}</arg_value>\n"
        "</tool_call><|observation|>\n<tool_response>\nsunny\n</tool_response><|assistant|>"
        + ("" if thinking else "\n<think></think>"))
    again = oai.chat.completions.create(messages=history, **kwargs).choices[0]
    assert again.finish_reason == "tool_calls"
