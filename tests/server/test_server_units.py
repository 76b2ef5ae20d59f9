"""Server pieces that need no engine: chat templates against transformers' renderer, the
tool-call parsers and the streaming output split, request validation, auth and error shapes on
a real HTTP server that is still "loading", and the routes over a scripted EngineClient."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.server_fixtures import (CALL_JSON, CHAT_TEMPLATE, ScriptedClient, serve_app,
                                           write_tokenizer)
from tidejax.config import EngineConfig
from tidejax.errors import EngineError
from tidejax.text.chat_template import ChatTemplate, TemplateRenderError
from tidejax.runtime.client import tool_format_for
from tidejax.runtime.sampling import SamplingParams
from tidejax.text.tokenizer import Tokenizer
from tidejax.server.app import Server
from tidejax.runtime.api import EngineInfo
from tidejax.text.toolcalls import DEEPSEEK_V3, GLM, HERMES, OutputParser, starts_in_reasoning

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

# A template in the style of published ones: namespace, loop controls, tojson options,
# raise_exception, strftime_now and a {% generation %} block.
RICH_TEMPLATE = """{%- set ns = namespace(system='') -%}
{%- for m in messages if m.role == 'system' %}{% set ns.system = m.content %}{% endfor -%}
{{ bos_token }}[date {{ strftime_now('%Y') | length }}]{{ ns.system }}
{%- if tools %}<tools>{{ tools | tojson(indent=2, sort_keys=True) }}</tools>{% endif %}
{%- for m in messages %}
  {%- if m.role == 'system' %}{% continue %}{% endif %}
  {%- if m.role not in ['user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
  {%- if m.role == 'assistant' %}<A>{% generation %}{{ m.content }}{% endgeneration %}
    {%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}{{ eos_token }}
  {%- else %}<{{ m.role[0] | upper }}>{{ m.content }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<A>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}{% endif %}"""

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris? \u00e9\u00e8 \u2603"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return path


@pytest.mark.parametrize("source", [CHAT_TEMPLATE, RICH_TEMPLATE], ids=["hermes", "rich"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["plain", "no_think"])
def test_template_renders_as_transformers(tokenizer_dir, source, kwargs):
    from transformers import PreTrainedTokenizerFast
    reference = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    ours = ChatTemplate.from_checkpoint(tokenizer_dir)
    ours = ChatTemplate(source, ours.special_tokens)
    for tools in (None, TOOLS):
        expected = reference.apply_chat_template(
            CONVERSATION, tools=tools, chat_template=source, add_generation_prompt=True,
            tokenize=False, **kwargs)
        assert ours.render(CONVERSATION, tools=tools, **kwargs) == expected


def test_template_from_checkpoint_files(tmp_path, tokenizer_dir):
    assert ChatTemplate.from_checkpoint(tokenizer_dir).source == CHAT_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}],
        "eos_token": {"content": "</s>", "special": True}}))
    assert ChatTemplate.from_checkpoint(tmp_path).render([]) == "D</s>"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert ChatTemplate.from_checkpoint(tmp_path).render([]) == "J"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TemplateRenderError, match="no chat template"):
        ChatTemplate.from_checkpoint(empty)


def test_template_errors_are_clear():
    t = ChatTemplate(RICH_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(TemplateRenderError, match="bad role robot"):
        t.render([{"role": "robot", "content": "x"}])
    with pytest.raises(TemplateRenderError, match="does not parse"):
        ChatTemplate("{% for %}", origin="x.jinja")
    with pytest.raises(TemplateRenderError):  # the sandbox refuses attribute escapes
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])


def test_tool_format_registry():
    assert tool_format_for("whatever", CHAT_TEMPLATE) is HERMES
    assert tool_format_for("deepseek_v3", CHAT_TEMPLATE) is HERMES  # the template decides
    assert tool_format_for("deepseek_v3", "no tools here") is DEEPSEEK_V3
    assert tool_format_for("x", "{{'<tool_call>'}}<arg_key>k</arg_key>") is GLM
    assert tool_format_for("x", "{{'<｜tool▁calls▁begin｜>'}}") is DEEPSEEK_V3
    assert tool_format_for("llama", "plain") is None


DEEPSEEK_V3_TEXT = ("Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                    "get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>"
                    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```"
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
DEEPSEEK_V31_TEXT = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                     "{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
GLM_TEXT = ("<think>user wants weather</think>Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
            "</tool_call>")
HERMES_TEXT = ("Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
               "{\"city\": \"Paris\"}}\n</tool_call>")


def run_parser(fmt, text, chunk, in_reasoning=False):
    parser = OutputParser(fmt, in_reasoning)
    pieces = []
    for i in range(0, len(text), chunk):
        pieces += parser.feed(text[i:i + chunk])
    pieces += parser.finish()
    joined = {k: "".join(t for kind, t in pieces if kind == k) for k in ("reasoning", "content")}
    return joined, [(c.name, json.loads(c.arguments)) for c in parser.tool_calls]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("fmt,text,content,reasoning,calls", [
    (DEEPSEEK_V3, DEEPSEEK_V3_TEXT, "Let me look.", "",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (DEEPSEEK_V3, DEEPSEEK_V31_TEXT, "", "", [("get_weather", {"city": "Paris"})]),
    (GLM, GLM_TEXT, "Sure.", "user wants weather", [("get_weather", {"city": "Paris", "days": 3})]),
    (HERMES, HERMES_TEXT, "Checking.\n", "", [("get_weather", {"city": "Paris"})]),
    (HERMES, "a <tool_cal b <think>c</think> d", "a <tool_cal b  d", "c", []),
], ids=["deepseek_v3", "deepseek_v31", "glm", "hermes", "no_call"])
def test_tool_calls_parse_at_any_chunking(fmt, text, content, reasoning, calls, chunk):
    assert run_parser(fmt, text, chunk) == ({"reasoning": reasoning, "content": content}, calls)


LONG = "1" * 5000  # more digits than Python reads from text
DEEP = "[" * 5000 + "]" * 5000  # deeper than Python's recursion limit


def test_malformed_tool_call_stays_content():
    bad = "x<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>"
    assert run_parser(HERMES, bad, 4) == ({"reasoning": "", "content": bad}, [])
    assert run_parser(None, HERMES_TEXT, 5)[0]["content"] == HERMES_TEXT  # tools not offered
    for value in (LONG, DEEP):  # what a model may write, as text
        bad = f"<tool_call>{{\"name\": \"f\", \"arguments\": {{\"a\": {value}}}}}</tool_call>"
        assert run_parser(HERMES, bad, 1000) == ({"reasoning": "", "content": bad}, [])
        bad = f"<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>{value}</arg_value>\n</tool_call>"
        assert run_parser(GLM, bad, 1000)[1] == [("f", {"a": value})]  # kept as its text


def test_reasoning_opened_by_the_template():
    assert starts_in_reasoning("<A><think>\n") and not starts_in_reasoning("<A><think></think>")
    assert run_parser(HERMES, "plan</think>answer", 3, in_reasoning=True) == (
        {"reasoning": "plan", "content": "answer"}, [])


# ---------------------------------------------------------------------------------------------
# The HTTP layer while the engine is loading: auth, validation and error shapes


KEY = "sk-test-123"


BODY_TIMEOUT = 1.0  # seconds the loading server waits for a body


@pytest.fixture(scope="module")
def loading_server(tokenizer_dir):
    """The real app on a real socket, with no engine attached (the state during weight loading)."""
    config = EngineConfig().with_overrides({
        "model": {"path": str(tokenizer_dir), "served_name": "tiny"},
        "server": {"api_keys": [KEY], "max_body_bytes": 65536, "body_timeout_s": BODY_TIMEOUT}})
    with serve_app(Server(config)) as url:
        yield url


def call(url, path, body=None, headers=None, method=None, raw=None):
    """(status, parsed JSON or text) of one request."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def test_health_open_and_loading(loading_server):
    assert call(loading_server, "/health") == (503, {"status": "loading", "model": "tiny"})
    status, body = call(loading_server, "/v1/models", headers=AUTH)
    assert status == 200 and body["data"][0]["id"] == "tiny"
    assert body["data"][0]["status"] == "loading"


@pytest.mark.parametrize("headers,status", [
    ({}, 401), ({"Authorization": "Bearer nope"}, 401), ({"x-api-key": "nope"}, 401),
    ({"Authorization": KEY}, 401),  # not a Bearer credential
    ({"x-api-key": b"\xff\xfe"}, 401), ({"Authorization": b"Bearer \xed\xa0\x80"}, 401),  # not UTF-8
    (AUTH, 503), ({"x-api-key": KEY}, 503), ({"Authorization": f"bearer {KEY}"}, 503),
])
def test_auth(loading_server, headers, status):
    got, body = call(loading_server, "/v1/chat/completions", CHAT, headers)
    assert got == status
    if status == 401:
        assert body["error"]["code"] == "invalid_api_key" and "API key" in body["error"]["message"]
        got, body = call(loading_server, "/v1/messages", {**CHAT, "max_tokens": 5}, headers)
        assert got == 401 and body == {"type": "error", "error": {
            "type": "authentication_error", "message": body["error"]["message"]}}
    else:  # past auth and validation: the engine is still loading
        assert "loading" in body["error"]["message"]
    assert call(loading_server, "/metrics", headers=headers)[0] == (200 if status == 503 else 401)


BAD_CHAT = [
    ({**CHAT, "temperature": "hot"}, "'temperature' should be a number"),
    ({**CHAT, "temperature": 3}, "'temperature' = 3.0 is out of range"),
    ({**CHAT, "top_p": 0}, "'top_p' = 0.0 is out of range"),
    ({**CHAT, "max_tokens": 0}, "'max_tokens' = 0 should be at least 1"),
    ({**CHAT, "max_tokens": True}, "'max_tokens' should be an integer"),
    ({**CHAT, "n": 9}, "'n' = 9 is out of range [1, 8]"),
    ({**CHAT, "n": 0}, "'n' = 0 is out of range"),
    ({**CHAT, "stream": "yes"}, "'stream' should be a boolean"),
    ({**CHAT, "stop": [1]}, "'stop' should be a string or an array"),
    ({"messages": CHAT["messages"]}, "'model' is required"),
    ({"model": "tiny"}, "'messages' is required"),
    ({"model": "tiny", "messages": []}, "'messages' should not be empty"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "'messages[0].role'"),
    ({"model": "tiny", "messages": [{"role": "user"}]}, "'messages[0].content' is required"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "'messages[0].content[0].type' = 'image_url' is not supported"),
    ({"model": "tiny", "messages": [{"role": "tool", "content": "x"}]},
     "'messages[0].tool_call_id' is required"),
    ({**CHAT, "tools": TOOLS, "tool_choice": "required"}, "'tool_choice'"),
    ({**CHAT, "response_format": {"type": "json_object"}}, "'response_format.type'"),
    ({**CHAT, "top_logprobs": 2}, "'top_logprobs' needs 'logprobs' = true"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "'top_logprobs' = 21 is out of range [0, 20]"),
    ({**CHAT, "logprobs": 1}, "'logprobs' should be a boolean"),
    ({**CHAT, "presence_penalty": 2.5}, "'presence_penalty' = 2.5 is out of range [-2.0, 2.0]"),
    ({**CHAT, "frequency_penalty": -3}, "'frequency_penalty' = -3.0 is out of range"),
    ({**CHAT, "repetition_penalty": 0}, "'repetition_penalty' should be above 0"),
    ({**CHAT, "min_p": 1.5}, "'min_p' = 1.5 is out of range [0.0, 1.0]"),
    ({**CHAT, "logit_bias": {"5": 101}}, "'logit_bias.5' = 101.0 is out of range [-100.0, 100.0]"),
    ({**CHAT, "logit_bias": {"x": 1}}, "'logit_bias' key \"x\" should be a token id"),
    ({**CHAT, "logit_bias": {"5": "a"}}, "'logit_bias.5' should be a number"),
    ({**CHAT, "logit_bias": {str(i): 1 for i in range(301)}}, "'logit_bias' has 301 entries"),
    ({**CHAT, "reasoning_effort": "max"}, "'reasoning_effort' = \"max\" should be one of"),
    ({**CHAT, "parallel_tool_calls": False}, "'parallel_tool_calls' = false"),
    ({**CHAT, "presence_penalty": False}, "'presence_penalty' should be a number"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "'stream_options' is only allowed"),
    ({**CHAT, "stream": True, "stream_options": {"include_usage": 1}},
     "'stream_options.include_usage' should be a boolean"),
    ({**CHAT, "chat_template_kwargs": {"tools": []}}, "'chat_template_kwargs.tools' is set by"),
    ({**CHAT, "chat_template_kwargs": {"messages": []}}, "'chat_template_kwargs.messages'"),
    ({**CHAT, "chat_template_kwargs": {"add_generation_prompt": False}},
     "'chat_template_kwargs.add_generation_prompt'"),
    ({**CHAT, "chat_template_kwargs": {"bos_token": "x"}}, "'chat_template_kwargs.bos_token'"),
    ({**CHAT, "stop": ["a"] * 17}, "'stop' has 17 sequences; at most 16"),
    ({**CHAT, "stop": ["a" * 257]}, "longer than 256 characters"),
    ({**CHAT, "tools": [{}] * 129}, "'tools' has 129 entries; at most 128"),
    ({"model": "tiny", "messages": [{}] * 4097}, "'messages' has 4097 entries; at most 4096"),
    ({**CHAT, "tools": [{"type": "function", "function": {}}]}, "'tools[0].function.name'"),
    ([1, 2], "body should be a JSON object"),
]


@pytest.mark.parametrize("body,message", BAD_CHAT, ids=[m for _, m in BAD_CHAT])
def test_bad_chat_requests(loading_server, body, message):
    status, got = call(loading_server, "/v1/chat/completions", body, AUTH)
    assert status == 400 and message in got["error"]["message"]
    assert got["error"]["type"] == "invalid_request_error"


def test_neutral_values_of_unsupported_parameters_pass(loading_server):
    """Values that ask for nothing (OpenAI's defaults) are no reason to refuse: the request goes
    on to the next check (here: the model is loading), as do the sampling parameters in range."""
    body = {**CHAT, "best_of": 1, "use_beam_search": False, "min_tokens": 0,
            "stop_token_ids": [], "parallel_tool_calls": True, "modalities": ["text"],
            "presence_penalty": 0.5, "frequency_penalty": -1, "n": 3, "logprobs": True,
            "top_logprobs": 20, "logit_bias": {"5": -100}, "min_p": 0.1,
            "repetition_penalty": 1.2, "reasoning_effort": "low",
            "stream": True, "stream_options": {"include_usage": True}}
    assert call(loading_server, "/v1/chat/completions", body, AUTH)[0] == 503


def test_bad_unicode_and_nesting(loading_server):
    """Lone surrogates and deep nesting: a 400 naming the field, never a 5xx."""
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    status, got = call(loading_server, "/v1/chat/completions", raw=raw, headers=AUTH)
    assert status == 400 and "'messages[0].content' holds text with a lone UTF-16 surrogate" in \
        got["error"]["message"] and got["error"]["param"] == "messages[0].content"
    raw = b'{"model": "tiny", "prompt": "x", "\\udfff": 1}'
    status, got = call(loading_server, "/v1/completions", raw=raw, headers=AUTH)
    assert status == 400 and "'body' holds a key with a lone UTF-16 surrogate" in \
        got["error"]["message"]
    for depth in (65, 1000, 1500):
        raw = b'{"model": "tiny", "prompt": "x", "user": ' + b"[" * depth + b"]" * depth + b"}"
        status, got = call(loading_server, "/v1/completions", raw=raw, headers=AUTH)
        assert status == 400 and "nested deeper than 64 levels" in got["error"]["message"]
    raw = b'{"model": "tiny", "prompt": "x", "user": ' + b"[" * 62 + b"]" * 62 + b"}"
    assert call(loading_server, "/v1/completions", raw=raw, headers=AUTH)[0] == 503


def test_bad_bodies(loading_server):
    status, got = call(loading_server, "/v1/chat/completions", raw=b"{nope", headers=AUTH)
    assert status == 400 and "not valid JSON" in got["error"]["message"]
    status, got = call(loading_server, "/v1/completions", raw=b"x" * 70_000, headers=AUTH)
    assert status == 413 and "too large" in got["error"]["message"]
    status, got = call(loading_server, "/v1/messages", raw=b"x" * 70_000, headers=AUTH)
    assert status == 413 and got["error"]["type"] == "request_too_large"
    status, got = call(loading_server, "/v1/nothing", CHAT, AUTH)
    assert status == 404 and "error" in got
    assert call(loading_server, "/v1/chat/completions", headers=AUTH, method="GET")[0] == 405


BAD_MESSAGES = [
    ({**CHAT}, "'max_tokens' is required"),
    ({**CHAT, "max_tokens": 5, "system": 3}, "'system' should be"),
    ({**CHAT, "max_tokens": 5, "tool_choice": {"type": "any"}}, "'tool_choice.type' = 'any'"),
    ({"model": "tiny", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
     "'messages[0].role' = 'system'"),
    ({"model": "tiny", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "'messages[0].content[0].type' = 'tool_use' is not supported in a user message"),
    ({**CHAT, "max_tokens": 5, "mcp_servers": [{"url": "x"}]}, "'mcp_servers'"),
    ({**CHAT, "max_tokens": 5, "stop_sequences": ["x"] * 17}, "'stop_sequences' has 17"),
    ({**CHAT, "max_tokens": 5, "thinking": {"type": "enabled"}},
     "'thinking.budget_tokens' is required"),
    ({**CHAT, "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 0}},
     "'thinking.budget_tokens' = 0 should be at least 1"),
    ({**CHAT, "max_tokens": 5, "thinking": {"type": "adaptive"}}, "'thinking.type' = \"adaptive\""),
]


@pytest.mark.parametrize("body,message", BAD_MESSAGES, ids=[m for _, m in BAD_MESSAGES])
def test_bad_anthropic_requests(loading_server, body, message):
    status, got = call(loading_server, "/v1/messages", body, {"x-api-key": KEY})
    assert status == 400 and got["type"] == "error"
    assert got["error"]["type"] == "invalid_request_error" and message in got["error"]["message"]


def test_bad_completion_requests(loading_server):
    for body, message in [({"model": "tiny"}, "'prompt' is required"),
                          ({"model": "tiny", "prompt": [1.5]}, "'prompt' should be a string"),
                          ({"model": "tiny", "prompt": "x", "logprobs": 21},
                           "'logprobs' = 21 is out of range [0, 20]"),
                          ({"model": "tiny", "prompt": "x", "n": 9}, "'n' = 9"),
                          ({"model": "tiny", "prompt": "x", "echo": True}, "'echo' = true"),
                          ({"model": "tiny", "prompt": "x", "best_of": 2}, "'best_of' = 2")]:
        status, got = call(loading_server, "/v1/completions", body, AUTH)
        assert status == 400 and message in got["error"]["message"]
    status, got = call(loading_server, "/v1/completions", {"model": "tiny", "prompt": "x"}, AUTH)
    assert status == 503


# ---------------------------------------------------------------------------------------------
# The routes over an EngineClient: all the server needs of an engine


def metric(url: str, name: str) -> float:
    text = call(url, "/metrics", headers=AUTH)[1]
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def test_a_body_that_does_not_arrive_in_time_is_cut_off(loading_server):
    """A client that sends its headers, then its body a byte at a time, gets a 408 naming
    server.body_timeout_s once that has passed, and the server closes the connection; /metrics
    counts it."""
    before = metric(loading_server, "tidejax_body_timeouts_total")
    host, port = loading_server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                     f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                     "Content-Length: 1000\r\n\r\n{".encode())
        start, received = time.monotonic(), b""
        while time.monotonic() - start < 10:
            if select.select([sock], [], [], 0.1)[0]:
                data = sock.recv(65536)
                if not data:
                    break  # closed by the server
                received += data
            else:
                with contextlib.suppress(OSError):  # the server may have closed it already
                    sock.sendall(b" ")
        elapsed = time.monotonic() - start
    assert received.startswith(b"HTTP/1.1 408"), received
    assert b"server.body_timeout_s = 1 s" in received
    assert BODY_TIMEOUT <= elapsed < BODY_TIMEOUT + 4, elapsed  # answered and closed in time
    assert metric(loading_server, "tidejax_body_timeouts_total") == before + 1


@pytest.fixture(scope="module")
def scripted_server(tokenizer_dir):
    """The app attached to a ScriptedClient that answers every request with a Hermes tool call."""
    tokenizer = Tokenizer(tokenizer_dir)
    info = EngineInfo("scripted", tokenizer, tokenizer.chat_template, HERMES, lanes=3,
                      max_context=1024)
    client = ScriptedClient(info, f"Sure.<tool_call>{CALL_JSON}</tool_call>", refuse_over=400)
    server = Server(EngineConfig().with_overrides({"model": {"path": str(tokenizer_dir)},
                                                   "server": {"max_tokens_limit": 64}}))
    server.attach(client)
    with serve_app(server) as url:
        yield url, client


def test_routes_over_an_engine_client(scripted_server):
    url, client = scripted_server
    assert call(url, "/health") == (200, {"status": "ready", "model": "scripted", "lanes": 3,
                                          "active": 2, "queued": 1})
    status, body = call(url, "/v1/chat/completions", {
        "model": "scripted", "messages": [{"role": "user", "content": "weather?"}],
        "tools": TOOLS, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3,
        "max_tokens": 20})
    assert status == 200 and body["choices"][0]["finish_reason"] == "tool_calls"
    message = body["choices"][0]["message"]
    assert message["content"] == "Sure."  # the info's tool format parsed the call out
    assert message["tool_calls"][0]["function"] == {"name": "get_weather",
                                                     "arguments": '{"city": "Paris"}'}
    # the body's sampling fields reach the engine as one SamplingParams
    assert client.requests[-1].sampling == SamplingParams(0.5, 0.9, 7, 3)
    assert client.requests[-1].max_new_tokens == 20
    status, body = call(url, "/v1/messages", {"model": "scripted", "max_tokens": 5,
                                              "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and body["stop_reason"] == "max_tokens"
    # the API's defaults; no seed, so the engine gives the request its own
    assert client.requests[-1].sampling == SamplingParams(temperature=1.0)
    metrics = call(url, "/metrics")[1]
    assert "tidejax_queue_waiting 1" in metrics and "tidejax_residency_misses 7" in metrics
    assert "geometry" not in metrics  # labels are not gauges
    rss = int(re.search(r"^tidejax_process_resident_memory_bytes (\d+)$", metrics, re.M).group(1))
    assert 2**20 < rss < 2**40


def test_choices_sampling_and_thinking_reach_the_engine(scripted_server, tokenizer_dir):
    """`n` choices are requests of their own (choice i seeded seed + i); logit_bias, penalties
    and logprobs ride in their SamplingParams; the reasoning fields set the template's
    enable_thinking and Anthropic's budget becomes the sampler's, ended by `</think>`."""
    url, client = scripted_server
    tokenizer = Tokenizer(tokenizer_dir)
    status, body = call(url, "/v1/chat/completions", {
        "model": "scripted", "messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 3,
        "max_tokens": 4, "logit_bias": {"7": 2.5}, "frequency_penalty": 0.5, "logprobs": True,
        "top_logprobs": 4})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    first, second = client.requests[-2:]
    assert (first.sampling.seed, second.sampling.seed) == (3, 4)
    assert first.sampling == SamplingParams(1.0, seed=3, logit_bias={7: 2.5},
                                            frequency_penalty=0.5, logprobs=4)
    assert body["usage"]["completion_tokens"] == 8
    status, body = call(url, "/v1/chat/completions", {
        "model": "scripted", "messages": [{"role": "user", "content": "hi"}],
        "logit_bias": {str(tokenizer.vocab_size): 1}})
    assert status == 400 and body["error"]["param"] == "logit_bias"
    think = tokenizer.token_id("<think>")
    for effort, opened in (("high", True), ("none", False)):
        status, _ = call(url, "/v1/chat/completions", {
            "model": "scripted", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "reasoning_effort": effort})
        assert status == 200 and (client.requests[-1].prompt_ids[-1] == think) == opened
    status, _ = call(url, "/v1/messages", {
        "model": "scripted", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "enabled", "budget_tokens": 3}})
    sampling = client.requests[-1].sampling
    assert status == 200 and client.requests[-1].prompt_ids[-1] == think
    assert (sampling.thinking_budget, sampling.thinking_end) == (3, tokenizer.token_id("</think>"))


def test_requests_the_engine_client_refuses(scripted_server):
    url, _ = scripted_server
    status, body = call(url, "/v1/completions", {"model": "scripted", "prompt": [5] * 500})
    assert status == 400 and "too many" in body["error"]["message"]
    status, body = call(url, "/v1/completions", {"model": "scripted", "prompt": "x",
                                                 "max_tokens": 65})
    assert status == 400 and "above this server's limit of 64" in body["error"]["message"]
    param = "messages[1].tool_calls[0].function.arguments"  # the template reads it as a mapping
    for arguments, message in ((f'{{"a": {LONG}}}', f"'{param}.a' is an integer of 5000 digits"),
                               (DEEP, f"'{param}' is nested deeper than 64 levels"),
                               ("[1]", f"'{param}' should be a JSON object")):
        status, body = call(url, "/v1/chat/completions", {"model": "scripted", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "f", "arguments": arguments}}]}]})
        assert status == 400 and body["error"]["message"].startswith(message), body
        assert body["error"]["param"].startswith(param)


@pytest.mark.parametrize("raised, message", [
    (ValueError("lane 3: index 7 out of bounds"), "internal error"),
    (EngineError("the engine failed and could not rebuild its state: lane 3"),
     "the engine failed on this request")])
def test_only_a_request_error_is_the_clients(scripted_server, monkeypatch, caplog, raised,
                                             message):
    """A ValueError (a bug) or an EngineError from the engine client is a 500 that does not
    repeat its text, logged once with its traceback; on both APIs."""
    url, client = scripted_server

    def submit(request):
        raise raised

    monkeypatch.setattr(client, "submit", submit)
    for path in ("/v1/completions", "/v1/messages"):
        caplog.clear()
        status, body = call(url, path, {"model": "scripted", "prompt": "x", "max_tokens": 2,
                                        "messages": [{"role": "user", "content": "hi"}]})
        assert status == 500 and message in json.dumps(body) and "lane 3" not in json.dumps(body)
        [record] = [r for r in caplog.records if r.levelname == "ERROR"]
        assert record.exc_info[1] is raised


# ---------------------------------------------------------------------------------------------
# Profiles and the command line


CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_profiles_parse_and_every_key_is_commented(path):
    config = EngineConfig.from_toml(path)
    # a bundled checkpoint, or none where the user must name theirs (the real-model profiles)
    assert not config.model.path or (Path(config.model.path) / "config.json").exists()
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            assert "#" in line.split("=", 1)[1], f"{path.name}: no comment on {line!r}"


@pytest.mark.parametrize("args,message", [
    (["--set", "engine.lanez=2"], "unknown key 'engine.lanez'"),
    (["--set", "engine.lanes=many"], "'engine.lanes' should be int"),
    (["--set", "residency.miss_policy=guess"], "'residency.miss_policy' = 'guess' is not one of"),
    (["--profile", "no_such_profile"], "profile 'no_such_profile' not found"),
])
def test_bad_profile_fails_at_start_naming_the_key(args, message):
    proc = subprocess.run([sys.executable, "-m", "tidejax.server", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
