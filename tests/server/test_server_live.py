"""The server end to end: `python -m tidejax.server` on a free loopback port, serving a tiny
DeepSeek-V3 checkpoint written by transformers, driven by the official openai and anthropic
clients. One server for the module (4 lanes, API key required)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.error
import urllib.request

import anthropic
import numpy as np
import openai
import pytest

from tests.support.server_fixtures import live_server, server_log, write_chat_model, write_profile

KEY = "sk-live-test"
LANES = 4
CONTEXT = 1024
LIMIT = 1000
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
GREEDY = {"temperature": 0}  # this anthropic SDK has no temperature argument; the API does
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Current weather in a city",
                     "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    model_dir = write_chat_model(root / "tiny")
    profile = write_profile(root / "live.toml", model_dir,
                            engine={"max_context": CONTEXT, "lanes": LANES, "prefill_chunk": 128},
                            # half the experts resident; "exact" keeps outputs all-resident
                            residency={"budget_experts": 4, "miss_policy": "exact"},
                            server={"api_keys": [KEY], "max_body_bytes": 65536,
                                    "max_tokens_limit": LIMIT})
    trace_dir = root / "trace"
    with live_server(profile, "--trace-dir", str(trace_dir)) as url:
        yield {"url": url, "model_dir": model_dir, "profile": profile}
    # --trace-dir: the profiler trace of the session is written at shutdown
    assert list(trace_dir.rglob("*.xplane.pb")), server_log(profile)


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served["url"], api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def hf_tokenizer(served):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(served["model_dir"])


def prompt_len(hf_tokenizer, messages, tools=None) -> int:
    """The prompt length transformers' own chat templating gives for this conversation."""
    return len(hf_tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"])


def get(url, path):
    request = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        body = r.read().decode()
    return json.loads(body) if path != "/metrics" else body


def test_models_and_health(served, oai):
    assert [m.id for m in oai.models.list().data] == ["tiny"]
    with urllib.request.urlopen(served["url"] + "/health", timeout=10) as r:  # open: no key
        health = json.load(r)
    assert health["status"] == "ready" and health["lanes"] == LANES


@pytest.fixture(scope="module")
def hf_model(served):
    from transformers import DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM.from_pretrained(served["model_dir"]).eval()


def test_completion_matches_transformers_greedy(served, oai, hf_tokenizer, hf_model):
    import torch
    model = hf_model
    ids = hf_tokenizer("The tide comes in and", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    expected = hf_tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    got = oai.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert got.choices[0].text == expected
    assert got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), 12)

    text_prompt = oai.completions.create(model="tiny", prompt="The tide comes in and",
                                         max_tokens=12, temperature=0)
    assert text_prompt.choices[0].text == expected
    chunks = list(oai.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    stats = chunks[-1].model_extra["x_engine_stats"]
    assert stats["decode_tps"] > 0 and 0 < stats["cold_share"] < 1  # misses served exactly
    assert stats["approx_weight_share"] == 0.0  # none approximately


def test_stop_strings(oai, claude):
    full = oai.completions.create(model="tiny", prompt="The tide", max_tokens=20,
                                  temperature=0).choices[0].text
    stop = full[5:7]
    cut = oai.completions.create(model="tiny", prompt="The tide", max_tokens=20, temperature=0,
                                 stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    messages = [{"role": "user", "content": "The tide"}]
    full = claude.messages.create(model="tiny", max_tokens=20, messages=messages,
                                  extra_body=GREEDY).content[0].text
    stop = full[6:8]
    cut = claude.messages.create(model="tiny", max_tokens=20, messages=messages,
                                 stop_sequences=["\u2603", stop], extra_body=GREEDY)
    assert cut.content[0].text == full[:full.index(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)


def test_chat_stream_and_not(oai, hf_tokenizer):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me about the tide."}]
    whole = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                        temperature=0)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == prompt_len(hf_tokenizer, messages)
    assert whole.usage.completion_tokens == 10
    assert set(whole.model_extra["x_engine_stats"]) == {"prefill_tps", "decode_tps", "cold_share",
                                                         "cpu_picks", "approx_weight_share"}

    chunks = list(oai.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.total_tokens == whole.usage.total_tokens
    stats = last.model_extra["x_engine_stats"]
    assert stats["prefill_tps"] > 0 and stats["decode_tps"] > 0 and 0 <= stats["cold_share"] <= 1


def test_tool_call_round_trip(oai, hf_tokenizer):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = oai.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                        max_tokens=20, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert first.usage.prompt_tokens == prompt_len(hf_tokenizer, messages, [WEATHER])

    streamed = list(oai.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                                max_tokens=20, temperature=0, stream=True))
    deltas = [tc for c in streamed if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        ("get_weather", {"city": "Paris"})]
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "tool_calls"

    history = messages + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = oai.chat.completions.create(model="tiny", messages=history, tools=[WEATHER],
                                         max_tokens=6, temperature=0)
    assert second.choices[0].finish_reason == "length"
    assert isinstance(second.choices[0].message.content, str)
    assert not second.choices[0].message.tool_calls
    # the template saw the call (arguments as a mapping) and the result, as transformers renders it
    reference = messages + [
        {"role": "assistant", "content": choice.message.content or "", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    assert second.usage.prompt_tokens == prompt_len(hf_tokenizer, reference, [WEATHER])


def test_reasoning_content(oai, claude):
    messages = [{"role": "user", "content": "Think first."}]
    out = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = out.choices[0].message
    assert message.content is None and message.model_extra["reasoning_content"]
    plain = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                        temperature=0)
    assert plain.choices[0].message.content and "reasoning_content" not in (
        plain.choices[0].message.model_extra or {})
    thought = claude.messages.create(model="tiny", max_tokens=5, messages=messages,
                                     thinking={"type": "enabled", "budget_tokens": 1024},
                                     extra_body=GREEDY)
    assert [b.type for b in thought.content] == ["thinking"]
    assert thought.content[0].thinking == message.model_extra["reasoning_content"]


def test_anthropic_messages(served, oai, claude):
    messages = [{"role": "user", "content": "Tell me about the tide."}]
    reference = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                            temperature=0).choices[0].message.content
    out = claude.messages.create(model="tiny", max_tokens=8, messages=messages, extra_body=GREEDY)
    assert [b.type for b in out.content] == ["text"] and out.content[0].text == reference
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 8

    with claude.messages.stream(model="tiny", max_tokens=8, messages=messages,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == reference and final.content[0].text == reference
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8

    # the raw event sequence (the SDK hides pings)
    events = raw_sse(served["url"] + "/v1/messages", {
        "model": "tiny", "max_tokens": 8, "messages": messages, "stream": True, **GREEDY})
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == kind for kind, data in events)
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == reference


def raw_sse(url: str, body: dict) -> list[tuple[str, dict]]:
    """(event, data) pairs of a server-sent-event response."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "x-api-key": KEY, "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    events = []
    for block in blocks:
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((fields["event"], json.loads(fields["data"])))
    return events


def test_anthropic_count_tokens(claude, hf_tokenizer):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    count = claude.messages.count_tokens(model="tiny", messages=messages, system="Be brief.",
                                         tools=[ANTHROPIC_WEATHER])
    reference = [{"role": "system", "content": "Be brief."}] + messages
    assert count.input_tokens == prompt_len(hf_tokenizer, reference, [WEATHER])


def test_anthropic_tool_use_round_trip(claude):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(model="tiny", max_tokens=20, messages=messages,
                                   tools=[ANTHROPIC_WEATHER])
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    assert use.id.startswith("toolu_")

    with claude.messages.stream(model="tiny", max_tokens=20, messages=messages,
                                tools=[ANTHROPIC_WEATHER]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        ("get_weather", {"city": "Paris"})]

    history = messages + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "sunny, 21 C"}]}]
    second = claude.messages.create(model="tiny", max_tokens=6, messages=history,
                                    tools=[ANTHROPIC_WEATHER])
    assert second.stop_reason == "max_tokens" and second.content[0].type == "text"
    assert second.usage.input_tokens > first.usage.input_tokens


def test_concurrent_streams_equal_one_at_a_time(served):
    prompts = [f"Request {i}: " + "the tide comes in " * (i % 4 + 1) for i in range(2 * LANES)]
    sync = openai.OpenAI(base_url=served["url"] + "/v1", api_key=KEY, max_retries=0)
    alone = [sync.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": p}], max_tokens=16,
        temperature=0).choices[0].message.content for p in prompts]

    async def one(client, prompt):
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=16,
            temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[:-1] == [None] * (len(finishes) - 1) and finishes[-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=served["url"] + "/v1", api_key=KEY,
                                      max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(all_at_once()) == alone


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_disconnect_frees_the_lane(served, oai):
    url = served["url"]
    long = dict(model="tiny", max_tokens=900, temperature=0, stream=True)
    finished = []

    def read_all(i):
        stream = oai.chat.completions.create(
            messages=[{"role": "user", "content": f"long {i}"}], **long)
        for _ in stream:
            pass
        finished.append(i)

    runners = [threading.Thread(target=read_all, args=(i,)) for i in range(LANES - 1)]
    for t in runners:
        t.start()
    dropped = oai.chat.completions.create(messages=[{"role": "user", "content": "dropped"}], **long)
    next(iter(dropped))
    wait_for(lambda: get(url, "/health")["active"] == LANES)

    short = {}
    waiter = threading.Thread(target=lambda: short.update(out=oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "short"}], max_tokens=3,
        temperature=0)))
    waiter.start()
    wait_for(lambda: get(url, "/health")["queued"] == 1)
    dropped.close()  # the client goes away mid-stream
    waiter.join(60)
    assert short["out"].choices[0].finish_reason == "length"
    assert finished == [], "the queued request should start when the lane frees, not later"
    for t in runners:
        t.join(120)
    assert sorted(finished) == list(range(LANES - 1))

    lines = [ln for ln in server_log(served["profile"]).splitlines() if " prompt=" in ln][-LANES - 1:]
    reasons = [re.search(r"finish=(\w+)", ln)[1] for ln in lines]
    generated = [int(re.search(r"generated=(\d+)", ln)[1]) for ln in lines]
    assert reasons[:2] == ["cancelled", "length"] and generated[0] < 900 and generated[1] == 3
    assert reasons[2:] == ["length"] * (LANES - 1) and generated[2:] == [900] * (LANES - 1)
    metrics = get(url, "/metrics")
    assert 'tidejax_generations_total{reason="cancelled"} 1' in metrics
    assert "Traceback" not in server_log(served["profile"])  # a client leaving is no error


def test_auth(served):
    wrong_oai = openai.OpenAI(base_url=served["url"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        wrong_oai.models.list()
    wrong = anthropic.Anthropic(base_url=served["url"], api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model="tiny", max_tokens=2,
                              messages=[{"role": "user", "content": "hi"}])
    request = urllib.request.Request(served["url"] + "/v1/models")
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(request, timeout=10)
    assert missing.value.code == 401
    for header in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        request = urllib.request.Request(served["url"] + "/v1/models", headers=header)
        with urllib.request.urlopen(request, timeout=10) as r:
            assert json.load(r)["data"][0]["id"] == "tiny"


def test_bad_input_then_success(served, oai, claude):
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="not served here"):
        oai.chat.completions.create(**{**chat, "model": "gpt-4"}, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context is 1024 tokens") as e:
        oai.completions.create(model="tiny", prompt=[5] * (CONTEXT + 10), max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError,
                       match="'max_tokens' = 1001 is above this server's limit of 1000"):
        oai.chat.completions.create(**chat, max_tokens=LIMIT + 1)
    with pytest.raises(openai.BadRequestError, match="does not fit"):
        oai.completions.create(model="tiny", prompt=[5] * 200, max_tokens=900)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        oai.completions.create(model="tiny", prompt=[10 ** 6], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="should be a number"):
        oai.chat.completions.create(**chat, temperature="warm")
    with pytest.raises(openai.APIStatusError, match="too large") as e:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 70000}])
    assert e.value.status_code == 413
    request = urllib.request.Request(served["url"] + "/v1/chat/completions", data=b"{oops",
                                     headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as bad_json:
        urllib.request.urlopen(request, timeout=10)
    assert bad_json.value.code == 400 and "not valid JSON" in json.load(bad_json.value)["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(**{**chat, "model": "claude-x"}, max_tokens=2)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="context"):
        claude.messages.create(model="tiny", max_tokens=2,
                               messages=[{"role": "user", "content": "tide " * 1200}])

    ok = oai.chat.completions.create(**chat, max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 3
    assert get(served["url"], "/health")["status"] == "ready"
    metrics = get(served["url"], "/metrics")
    assert re.search(r'tidejax_http_responses_total\{route="/v1/chat/completions",status="400"\} [1-9]',
                     metrics)
    assert re.search(r"tidejax_generated_tokens_total [1-9]", metrics)
    assert re.search(r"tidejax_residency_misses [1-9]", metrics)
    assert re.search(r"tidejax_residency_swaps_applied \d+", metrics)
    assert re.search(r"tidejax_kv_pages_in_use \d+", metrics)  # the shared KV pool
    assert re.search(r"tidejax_kv_preemptions \d+", metrics)



# ---------------------------------------------------------------------------------------------
# Sampling parameters, logprobs and n through the openai client, against transformers' logits


def hf_greedy(model, ids: list[int], n: int, presence=0.0, frequency=0.0, repetition=1.0):
    """Greedy tokens over transformers' logits with the penalties applied in numpy (repetition
    over the prompt and the output, transformers' way; presence and frequency over the output,
    OpenAI's), and each token's log-probability under them."""
    import torch
    counts = np.zeros(model.config.vocab_size)
    tokens, logprobs = [], []
    for _ in range(n):
        with torch.no_grad():
            x = model(torch.tensor([ids + tokens])).logits[0, -1].double().numpy()
        seen = np.isin(np.arange(len(x)), ids + tokens)
        x = np.where(seen, np.where(x > 0, x / repetition, x * repetition), x)
        x = x - frequency * counts - presence * (counts > 0)
        logp = x - x.max() - np.log(np.exp(x - x.max()).sum())
        tokens.append(int(np.argmax(x)))
        logprobs.append(float(logp[tokens[-1]]))
        counts[tokens[-1]] += 1
    return tokens, logprobs


def test_penalties_and_logit_bias_change_the_output_as_numpy_predicts(oai, hf_tokenizer, hf_model):
    ids = hf_tokenizer("The tide comes in and", add_special_tokens=False)["input_ids"]
    plain = hf_greedy(hf_model, ids, 10)[0]
    want = hf_greedy(hf_model, ids, 10, presence=-2.0, frequency=1.5, repetition=0.05)[0]
    assert want != plain  # the penalties change this output
    got = oai.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0,
                                 presence_penalty=-2.0, frequency_penalty=1.5,
                                 extra_body={"repetition_penalty": 0.05})
    assert got.choices[0].text == hf_tokenizer.decode(want)
    forced = hf_tokenizer.convert_tokens_to_ids("ide")
    got = oai.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0,
                                 logit_bias={str(forced): 100})
    assert got.choices[0].text == hf_tokenizer.decode([forced] * 4)
    with pytest.raises(openai.BadRequestError, match="'logit_bias' has token id 99999"):
        oai.completions.create(model="tiny", prompt=ids, max_tokens=4, logit_bias={"99999": 1})
    with pytest.raises(openai.BadRequestError, match="'presence_penalty' = 3.0 is out of range"):
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                    presence_penalty=3)


def test_logprobs_in_openai_shapes(oai, hf_tokenizer, hf_model):
    ids = hf_tokenizer("The tide comes in and", add_special_tokens=False)["input_ids"]
    tokens, logprobs = hf_greedy(hf_model, ids, 6)
    got = oai.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0,
                                 logprobs=3).choices[0]
    lp = got.logprobs
    assert lp.tokens == [hf_tokenizer.decode([t]) for t in tokens]
    np.testing.assert_allclose(lp.token_logprobs, logprobs, atol=1e-3)
    # greedy: the token is the best; two alternatives may print alike (a cut UTF-8 character)
    assert all(1 <= len(top) <= 3 and max(top.values()) == pytest.approx(best, abs=1e-6)
               for top, best in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[-1] <= len(got.text)
    streamed = list(oai.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0,
                                           logprobs=3, stream=True))
    assert [t for c in streamed if c.choices[0].logprobs
            for t in c.choices[0].logprobs.tokens] == lp.tokens

    messages = [{"role": "user", "content": "Tell me about the tide."}]
    whole = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                        temperature=0, logprobs=True, top_logprobs=2).choices[0]
    content = whole.logprobs.content
    assert len(content) == 6 and all(len(e.top_logprobs) == 2 for e in content)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == \
        whole.message.content  # the exact bytes, even of a cut character
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-6) and
               e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    chunks = list(oai.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                              temperature=0, logprobs=True, top_logprobs=2,
                                              stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    np.testing.assert_allclose([e.logprob for e in streamed], [e.logprob for e in content],
                               atol=1e-5)
    plain = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_n_choices(oai):
    messages = [{"role": "user", "content": "Tell me about the tide."}]
    sampled = dict(model="tiny", messages=messages, max_tokens=6, temperature=1.0)
    both = oai.chat.completions.create(n=2, seed=5, **sampled)
    assert [c.index for c in both.choices] == [0, 1]
    alone = [oai.chat.completions.create(seed=seed, **sampled).choices[0].message.content
             for seed in (5, 6)]  # choice i samples with seed + i
    assert [c.message.content for c in both.choices] == alone
    assert both.usage.completion_tokens == 12
    chunks = list(oai.chat.completions.create(n=2, seed=5, stream=True, **sampled))
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert [texts[0], texts[1]] == alone
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1]
    completions = oai.completions.create(model="tiny", prompt="The tide", max_tokens=4, n=3,
                                         temperature=0)
    assert len({c.text for c in completions.choices}) == 1 and len(completions.choices) == 3


def test_reasoning_fields_map_to_the_template_switch(oai, claude):
    """This template reads enable_thinking: reasoning_effort and Anthropic's thinking set it;
    budget_tokens ends the reasoning with </think> after that many tokens."""
    messages = [{"role": "user", "content": "Think first."}]
    high = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                       temperature=0, reasoning_effort="high").choices[0].message
    assert high.content is None and high.model_extra["reasoning_content"]
    off = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                      temperature=0, reasoning_effort="none").choices[0].message
    assert off.content and "reasoning_content" not in (off.model_extra or {})
    with pytest.raises(openai.BadRequestError, match="both set the thinking control"):
        oai.chat.completions.create(model="tiny", messages=messages, reasoning_effort="low",
                                    extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    cut = claude.messages.create(model="tiny", max_tokens=8, messages=messages,
                                 thinking={"type": "enabled", "budget_tokens": 2},
                                 extra_body=GREEDY)
    assert [b.type for b in cut.content] == ["thinking", "text"]
    assert high.model_extra["reasoning_content"].startswith(cut.content[0].thinking)
    assert cut.content[0].thinking and cut.usage.output_tokens == 8
    off = claude.messages.create(model="tiny", max_tokens=5, messages=messages,
                                 thinking={"type": "disabled"}, extra_body=GREEDY)
    assert [b.type for b in off.content] == ["text"]
