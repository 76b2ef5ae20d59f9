"""The chat formats of gpt-oss (harmony), Qwen3, MiniMax-M2, Mixtral and GLM-4.5 without an
engine: the prompt the server renders from an OpenAI request with each family's template (tool
call, its reasoning, tool result, the thinking controls) against transformers'
apply_chat_template on the messages as the template reads them, token for token; and fixed
replies in each format through the output parsers, streamed in chunks of every size and
whole."""

from __future__ import annotations

import json

import pytest

from tests.support.chat_models import CHAT_FAMILIES, THOUGHT, WEATHER, write_chat_tokenizer
from tidejax.errors import RequestError
from tidejax.runtime.api import EngineInfo
from tidejax.runtime.client import tool_format_for
from tidejax.server.generation import ServedModel
from tidejax.server.schemas import Fields, parse_chat
from tidejax.text.harmony import HARMONY
from tidejax.text.tokenizer import Tokenizer
from tidejax.text.toolcalls import GLM, HERMES, MINIMAX_M2, MISTRAL

# Mixtral's template takes only ids of 9 letters or digits
CALL = {"id": "call00001", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
CONVERSATION = [  # as an OpenAI client sends it
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": THOUGHT, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call00001", "content": "sunny"},
]


def as_template_reads(family: str) -> list[dict]:
    """CONVERSATION as the family's template takes it: the arguments a mapping, the reasoning
    under gpt-oss's `thinking` (the published templates' own documentation says so)."""
    key = "thinking" if family == "gpt_oss" else "reasoning_content"
    call = {**CALL, "function": {**CALL["function"], "arguments": {"city": "Paris", "days": 2}}}
    assistant = {"role": "assistant", "content": "", key: THOUGHT, "tool_calls": [call]}
    return [CONVERSATION[0], CONVERSATION[1], assistant, CONVERSATION[3]]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """family -> (our Tokenizer, transformers' tokenizer) over the family's chat tokenizer."""
    from transformers import PreTrainedTokenizerFast
    out = {}
    for family in CHAT_FAMILIES:
        path = tmp_path_factory.mktemp(family)
        write_chat_tokenizer(family, path)
        out[family] = Tokenizer(path), PreTrainedTokenizerFast.from_pretrained(path)
    return out


def served_model(tokenizer: Tokenizer, family: str) -> ServedModel:
    template = tokenizer.chat_template
    info = EngineInfo(family, tokenizer, template, tool_format_for(family, template.source),
                      lanes=1, max_context=4096)
    return ServedModel.of(info, max_tokens_limit=64)


# family -> (request fields, the template kwargs transformers is given for them)
THINKING = {
    "gpt_oss": [({}, {}), ({"reasoning_effort": "low"}, {"reasoning_effort": "low"}),
                ({"reasoning_effort": "high"}, {"reasoning_effort": "high"})],
    "qwen3_moe": [({}, {}), ({"reasoning_effort": "none"}, {"enable_thinking": False}),
                  ({"chat_template_kwargs": {"enable_thinking": False}},
                   {"enable_thinking": False})],
    "minimax_m2": [({}, {})],
    "mixtral": [({}, {})],
    "glm4_moe": [({}, {}), ({"reasoning_effort": "none"}, {"enable_thinking": False}),
                 ({"chat_template_kwargs": {"enable_thinking": False}},
                  {"enable_thinking": False})],
}


@pytest.mark.parametrize("family", CHAT_FAMILIES)
def test_requests_render_as_transformers_renders_the_published_template(tokenizers, family):
    ours, reference = tokenizers[family]
    model = served_model(ours, family)
    for fields, kwargs in THINKING[family]:
        for messages, expected in ((CONVERSATION, as_template_reads(family)),
                                   (CONVERSATION[:2], CONVERSATION[:2])):
            chat = parse_chat(Fields({"model": family, "messages": messages, "tools": [WEATHER],
                                      **fields}))
            ids, in_reasoning = model.chat_prompt(chat)
            # each control changes the prompt: equal ids show it reached the template
            assert ids == reference.apply_chat_template(
                expected, tools=[WEATHER], add_generation_prompt=True, return_dict=True,
                **kwargs)["input_ids"], (family, fields)
            # MiniMax-M2's prompt opens <think> for the model; gpt-oss's and Qwen3's do not
            assert in_reasoning == (family == "minimax_m2")


def test_thinking_controls_each_template_lacks_are_refused(tokenizers):
    """gpt-oss takes low, medium and high (no off switch); MiniMax-M2's template has no thinking
    control: each refusal names reasoning_effort."""
    for family, effort in (("gpt_oss", "minimal"), ("gpt_oss", "none"), ("minimax_m2", "high")):
        model = served_model(tokenizers[family][0], family)
        chat = parse_chat(Fields({"model": family, "messages": CONVERSATION[:2],
                                  "reasoning_effort": effort}))
        with pytest.raises(RequestError) as refused:
            model.chat_prompt(chat)
        assert refused.value.field == "reasoning_effort"


def test_formats_are_read_from_the_templates_and_the_families():
    for family, fmt in (("gpt_oss", HARMONY), ("qwen3_moe", HERMES), ("minimax_m2", MINIMAX_M2),
                        ("mixtral", MISTRAL), ("glm4_moe", GLM)):
        assert tool_format_for("unknown", CHAT_FAMILIES[family].template) is fmt
        assert tool_format_for(family, "{{ messages }}") is fmt


def parse(fmt, text: str, chunk: int, tools=(WEATHER,), in_reasoning: bool = False):
    """`text` fed to `fmt`'s parser `chunk` characters at a time: ({kind: text}, calls)."""
    parser = fmt.parser(in_reasoning, list(tools) or None)
    pieces = [p for i in range(0, len(text), chunk) for p in parser.feed(text[i:i + chunk])]
    pieces += parser.finish()
    joined = {k: "".join(t for kind, t in pieces if kind == k) for k in ("reasoning", "content")}
    return joined, [(c.name, json.loads(c.arguments)) for c in parser.tool_calls]


ANALYSIS = "<|channel|>analysis<|message|>User asks for weather; call the tool.<|end|>"
HARMONY_REPLIES = [
    # reasoning then an answer; the engine stops before <|return|> (an end-of-turn token)
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is <b>sunny</b>.",
     "It is <b>sunny</b>.", []),
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Done.<|return|>", "Done.", []),
    # a preamble on commentary, then a call as gpt-oss writes it
    (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
     '<|message|>{"city": "Paris", "days": 3}', "Checking.",
     [("get_weather", {"city": "Paris", "days": 3})]),
    # the recipient after the role, as the template writes a call back
    (ANALYSIS + "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
     '<|message|>{"city":"Oslo"}<|call|>', "", [("get_weather", {"city": "Oslo"})]),
]


@pytest.mark.parametrize("chunk", [1, 3, 7, 10_000])
@pytest.mark.parametrize("text,content,calls", HARMONY_REPLIES,
                         ids=["final", "final_return", "preamble_call", "recipient_first"])
def test_harmony_channels_and_calls_at_any_chunking(text, content, calls, chunk):
    reasoning = "User asks for weather; call the tool."
    assert parse(HARMONY, text, chunk) == ({"reasoning": reasoning, "content": content}, calls)


def test_harmony_streams_a_body_as_it_comes():
    """A body goes out as it arrives (only a possible end marker's first characters wait); a
    header and a call's arguments wait for their end."""
    parser = HARMONY.parser(False, [WEATHER])
    assert parser.feed("<|channel|>analy") == []
    assert parser.feed("sis<|message|>Thinking a<|") == [("reasoning", "Thinking a")]
    assert parser.feed("b<|end|><|start|>assistant<|channel|>final<|message|>Hi") == [
        ("reasoning", "<|b"), ("content", "Hi")]


def test_harmony_calls_without_tools_or_json_stay_content():
    call = ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city": "Paris"}')
    assert parse(HARMONY, call, 5, tools=()) == ({"reasoning": "", "content": '{"city": "Paris"}'},
                                                 [])
    broken = call.replace('{"city": "Paris"}', '{"city": ')
    assert parse(HARMONY, broken, 5) == ({"reasoning": "", "content": broken}, [])
    # a reply with no harmony header at all (what a random model writes) is content
    assert parse(HARMONY, "plain words", 4) == ({"reasoning": "", "content": "plain words"}, [])


QWEN3_REPLY = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n'
               '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
MINIMAX_REPLY = ('The user wants weather.\n</think>\n\nLet me check.\n<minimax:tool_call>\n'
                 '<invoke name="get_weather">\n<parameter name="city">1984</parameter>\n'
                 '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="lookup">\n'
                 '<parameter name="q">{"a": [1, 2]}</parameter>\n<parameter name="note">multi\n'
                 'line</parameter>\n</invoke>\n</minimax:tool_call>')


@pytest.mark.parametrize("chunk", [1, 3, 7, 10_000])
def test_qwen3_thinking_and_hermes_calls_at_any_chunking(chunk):
    """Qwen3 opens <think> itself (its prompt does not)."""
    assert parse(HERMES, QWEN3_REPLY, chunk) == (
        {"reasoning": "\nThe user wants weather.\n", "content": "\n\nLet me check.\n"},
        [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})])


@pytest.mark.parametrize("chunk", [1, 3, 7, 10_000])
def test_minimax_m2_invokes_at_any_chunking(chunk):
    """The prompt opened <think>; a value stays text where the tool's schema says string (city
    "1984"), JSON where it parses otherwise, text where it does not."""
    assert parse(MINIMAX_M2, MINIMAX_REPLY, chunk, in_reasoning=True) == (
        {"reasoning": "The user wants weather.\n", "content": "\n\nLet me check.\n"},
        [("get_weather", {"city": "1984", "days": 3}),
         ("lookup", {"q": {"a": [1, 2]}, "note": "multi\nline"})])


def test_broken_minimax_m2_invokes_stay_content():
    for bad in ('<minimax:tool_call>\n<invoke name="">\n</invoke>\n</minimax:tool_call>',
                '<minimax:tool_call><invoke name="f"><parameter name="a">1</invoke>'
                '</minimax:tool_call>'):
        assert parse(MINIMAX_M2, bad, 4) == ({"reasoning": "", "content": bad}, [])


MISTRAL_REPLY = ('Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
                 '"Paris", "days": 3}, "id": "a1B2c3D4e"}, {"name": "get_time", "arguments": '
                 '"{}"}]')


@pytest.mark.parametrize("chunk", [1, 3, 7, 10_000])
def test_mistral_tool_call_list_at_any_chunking(chunk):
    """Mixtral's [TOOL_CALLS] list: the text before it is content, each call of the list a call
    (arguments an object or its JSON text)."""
    assert parse(MISTRAL, MISTRAL_REPLY, chunk) == (
        {"reasoning": "", "content": "Let me check. "},
        [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})])


def test_mistral_call_ids_are_what_its_template_takes():
    """A written id of 9 letters or digits is kept; a call without one, or with another, gets
    one of 9: the template refuses any other id in the history."""
    parser = MISTRAL.parser(False, [WEATHER])
    parser.feed(MISTRAL_REPLY.replace('"get_time", ', '"get_time", "id": "call_1", '))
    parser.finish()
    kept, made = parser.tool_calls
    assert kept.id == "a1B2c3D4e"
    assert len(made.id) == 9 and made.id.isalnum()


def test_mistral_lists_one_after_another_are_all_read():
    text = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
            '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]')
    assert parse(MISTRAL, text, 5)[1] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]


def test_broken_mistral_calls_stay_content():
    for bad in ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}] and more',
                '[TOOL_CALLS] [{"arguments": {}}]', '[TOOL_CALLS] {"name": "f"}',
                '[TOOL_CALLS] [{"name": "f", "arguments": [1]}]', '[TOOL_CALLS] []'):
        assert parse(MISTRAL, bad, 4) == ({"reasoning": "", "content": bad}, [])
