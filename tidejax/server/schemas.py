"""Request schemas: the JSON bodies of the OpenAI and Anthropic routes, checked field by field
and turned into one internal shape (`ChatInput` / `CompletionInput`). Every problem raises a
`RequestError` that names the field."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from tidejax.errors import RequestError
from tidejax.runtime.api import SamplingError, SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")

# caps on what one request may carry (each check names its field)
MAX_DEPTH = 64  # nesting of objects and arrays in a body
MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_STOP = 16  # stop sequences
MAX_STOP_CHARS = 256  # characters of one stop sequence
MAX_N = 8  # choices of one request (`n`), each a lane of its own
MAX_TOKEN_ID_DIGITS = 10  # a logit_bias key (vocabularies are far below 10**10)

# OpenAI's reasoning_effort values; "none" and "minimal" turn a thinking switch off
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")

# chat_template_kwargs a request may not set, and why: the server passes them itself (or the
# template's own special tokens), or Jinja keeps the name
_BY_SERVER = "set by the server (send no such key)"
RESERVED_TEMPLATE_KWARGS = {
    "messages": "set by the server (send it as the request field)",
    "tools": "set by the server (send it as the request field)",
    **dict.fromkeys(("documents", "add_generation_prompt", "continue_final", "bos_token",
                     "eos_token", "unk_token", "pad_token"), _BY_SERVER),
    "self": "Jinja's name for the template itself (send no such key)",
}

# Parameters this server does not implement: each one's values that ask for nothing (what the
# server does anyway). Any other value is refused with a 400 naming every such parameter.
_SAMPLING_NEUTRAL = {
    "best_of": (1,), "use_beam_search": (False,), "length_penalty": (1,), "min_tokens": (0,),
    "stop_token_ids": ([],), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "structured_outputs": (),
}
UNSUPPORTED = {
    "chat": {**_SAMPLING_NEUTRAL, "parallel_tool_calls": (True,), "prediction": (),
             "audio": (), "modalities": (["text"],), "web_search_options": ()},
    "completion": {**_SAMPLING_NEUTRAL, "echo": (False,), "suffix": ("",)},
    "messages": {"mcp_servers": ([],), "container": ()},
}


@dataclasses.dataclass(frozen=True)
class GenerationOptions:
    """A request's generation fields: the engine's sampling as is, plus the token budget, the
    stop strings the server applies and the number of choices."""

    sampling: SamplingParams
    max_tokens: int | None  # None: up to the context or the server's limit
    max_tokens_param: str = "max_tokens"  # the request field that set it, for error messages
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks)
    n: int = 1  # independent choices of the same prompt, each a request of its own
    logprobs_param: str = "logprobs"  # the request field that asked for the top logprobs


@dataclasses.dataclass(frozen=True)
class Thinking:
    """What a request asks of the model's reasoning, mapped onto the chat template's thinking
    control by the server (generation.ServedModel): on or off, OpenAI's effort, Anthropic's
    budget of reasoning tokens (0: none); `param` names the field that asked."""

    enabled: bool
    param: str
    effort: str | None = None
    budget: int = 0


@dataclasses.dataclass(frozen=True)
class ChatInput:
    model: str
    messages: list[dict]  # OpenAI-shaped messages, content as strings
    tools: list[dict] | None  # OpenAI function tools, None when none may be called
    template_kwargs: dict
    options: GenerationOptions
    stream: bool
    include_usage: bool = False  # a stream's last chunk carries the usage (OpenAI stream_options)
    thinking: Thinking | None = None  # None: the template's default
    continue_final: bool = False  # the last (assistant) message is continued, not answered


@dataclasses.dataclass(frozen=True)
class CompletionInput:
    model: str
    prompt: str | list[int]
    options: GenerationOptions
    stream: bool
    include_usage: bool = False


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "an array", dict: "an object"}


class Fields:
    """Typed access to a JSON object; `where` prefixes field names in errors (`messages[2].`)."""

    def __init__(self, raw: Any, where: str = ""):
        if not isinstance(raw, dict):
            raise RequestError(f"{where.rstrip('.') or 'body'} should be a JSON object",
                               field=where.rstrip(".") or None)
        self.raw, self.where = raw, where

    def get(self, name: str, kind: type | tuple, default: Any = None, required: bool = False):
        param = self.where + name
        value = self.raw.get(name)
        if value is None:
            if required:
                raise RequestError(f"'{param}' is required", field=param)
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:
                raise RequestError(f"'{param}' = an integer of {len(str(abs(value)))} digits is "
                                   "out of range", field=param) from None
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(_TYPE_NAMES[k] for k in kinds)
            raise RequestError(f"'{param}' should be {names}, got {json.dumps(value)[:80]}",
                               field=param)
        return value

    def number(self, name: str, default: float, low: float, high: float,
               low_open: bool = False) -> float:
        value = self.get(name, float, default)
        if value < low or value > high or (low_open and value == low):
            bracket = "(" if low_open else "["
            raise RequestError(f"'{self.where + name}' = {value} is out of range "
                               f"{bracket}{low}, {high}]", field=self.where + name)
        return value


class _LongInt:
    """A JSON integer with more digits than Python converts (sys.get_int_max_str_digits)."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))


def _int(text: str) -> int | _LongInt:
    try:
        return int(text)
    except ValueError:
        return _LongInt(text)


def parse_json(text: bytes) -> Fields:
    """The body as an object (load_json's checks)."""
    return Fields(load_json(text))


def load_json(text: bytes | str, where: str = "") -> Any:
    """`text` parsed, every string in it valid Unicode (no lone surrogates), no deeper than
    MAX_DEPTH and no integer longer than Python reads; errors name `where`, the field that held
    the text (else the body)."""
    what = f"'{where}'" if where else "request body"
    try:
        body = json.loads(text, parse_int=_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"{what} is not valid JSON: {e}", field=where or None) from None
    except RecursionError:
        raise RequestError(f"{what} is nested deeper than {MAX_DEPTH} levels",
                           field=where or None) from None
    stack = [(body, where, 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                raise RequestError(f"request body is nested deeper than {MAX_DEPTH} levels "
                                   f"(at '{where or 'body'}')", field=where or None)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):  # checked before it names a field in a message
                    _unicode(key, where or "body", "a key")
                    path = f"{where}.{key}" if where else key
                else:
                    path = f"{where}[{key}]"
                stack.append((item, path, depth + 1))
        elif isinstance(value, str):
            _unicode(value, where or "body", "text")
        elif isinstance(value, _LongInt):
            raise RequestError(f"'{where or 'body'}' is an integer of {value.digits} digits (at "
                               f"most {sys.get_int_max_str_digits()})", field=where or None)
    return body


def _unicode(text: str, where: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"'{where}' holds {what} with a lone UTF-16 surrogate (not valid "
                           "Unicode)", field=where) from None


def refuse_unsupported(body: Fields, route: str) -> None:
    """A 400 naming every parameter in UNSUPPORTED[route] given with a value that asks for
    something this server does not do."""
    asked = [(name, body.raw[name]) for name, neutral in UNSUPPORTED[route].items()
             if body.raw.get(name) is not None
             and not any(_same(body.raw[name], n) for n in neutral)]
    if asked:
        listed = ", ".join(f"'{name}' = {json.dumps(value)[:40]}" for name, value in asked)
        raise RequestError(f"not supported by this server: {listed} (leave "
                           f"{'it' if len(asked) == 1 else 'them'} out)", field=asked[0][0])


def _same(value: Any, neutral: Any) -> bool:
    """Equal and of one JSON kind (false is not 0; 1 and 1.0 are one number)."""
    def kind(v):
        return "number" if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v)
    return kind(value) == kind(neutral) and value == neutral


def _max_tokens(body: Fields, *names: str, required: bool = False) -> tuple[int | None, str]:
    """The first of `names` present (chat takes max_completion_tokens or max_tokens) and its
    name."""
    for name in names:
        value = body.get(name, int)
        if value is not None:
            if value < 1:
                raise RequestError(f"'{name}' = {value} should be at least 1", field=name)
            return value, name
    if required:
        raise RequestError(f"'{names[0]}' is required", field=names[0])
    return None, names[-1]


def _stop(body: Fields, name: str) -> tuple[str, ...]:
    stop = body.get(name, (str, list), ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"'{name}' should be a string or an array of non-empty strings",
                           field=name)
    if len(stop) > MAX_STOP:
        raise RequestError(f"'{name}' has {len(stop)} sequences; at most {MAX_STOP}", field=name)
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise RequestError(f"'{name}': a stop sequence is longer than {MAX_STOP_CHARS} "
                           "characters", field=name)
    return stop


def _list(body: Fields, name: str, cap: int, required: bool = False) -> list | None:
    value = body.get(name, list, required=required)
    if value is not None and len(value) > cap:
        raise RequestError(f"'{name}' has {len(value)} entries; at most {cap}", field=name)
    return value


def _include_usage(body: Fields, stream: bool) -> bool:
    """OpenAI's stream_options.include_usage: a last chunk with the usage (and x_engine_stats)."""
    options = body.get("stream_options", dict)
    if options is None:
        return False
    if not stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true",
                           field="stream_options")
    return Fields(options, "stream_options.").get("include_usage", bool, False)


def _options(body: Fields, max_tokens: tuple[int | None, str], stop: tuple[str, ...],
             logprobs: tuple[int | None, str] = (None, "logprobs"),
             n: int = 1) -> GenerationOptions:
    """The generation fields every route shares; `logprobs` (the top logprobs asked for, and the
    field that asked) and `n` come from the OpenAI routes."""
    top_k = body.get("top_k", int, 0)
    if top_k < -1:
        raise RequestError(f"'top_k' = {top_k} should be -1 or 0 (off) or positive",
                           field="top_k")
    fields = {"logprobs": logprobs[1]}  # SamplingParams' field -> the request's
    try:
        sampling = SamplingParams(
            temperature=body.number("temperature", 1.0, 0.0, 2.0),
            top_p=body.number("top_p", 1.0, 0.0, 1.0, low_open=True), top_k=max(top_k, 0),
            seed=body.get("seed", int), min_p=body.get("min_p", float, 0.0),
            presence_penalty=body.get("presence_penalty", float, 0.0),
            frequency_penalty=body.get("frequency_penalty", float, 0.0),
            repetition_penalty=body.get("repetition_penalty", float, 1.0),
            logit_bias=_logit_bias(body), logprobs=logprobs[0])
    except SamplingError as e:
        name = fields.get(e.field, e.field)
        raise RequestError(str(e).replace(f"'{e.field}'", f"'{name}'", 1), field=name) from None
    return GenerationOptions(sampling, max_tokens=max_tokens[0], max_tokens_param=max_tokens[1],
                             stop=stop, ignore_eos=body.get("ignore_eos", bool, False), n=n,
                             logprobs_param=logprobs[1])


def _logit_bias(body: Fields) -> dict[int, float]:
    """OpenAI's logit_bias: an object of token id (a string of digits) -> bias."""
    raw = body.get("logit_bias", dict, {})
    entries = Fields(raw, "logit_bias.")
    bias = {}
    for key in raw:
        if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
            raise RequestError(f"'logit_bias' key {json.dumps(key)[:40]} should be a token id",
                               field="logit_bias")
        bias[int(key)] = entries.get(key, float, required=True)
    return bias


def _n(body: Fields) -> int:
    n = body.get("n", int, 1)
    if not 1 <= n <= MAX_N:
        raise RequestError(f"'n' = {n} is out of range [1, {MAX_N}]", field="n")
    return n


def _chat_logprobs(body: Fields) -> tuple[int | None, str]:
    """Chat's logprobs (a boolean) and top_logprobs (0..20, with logprobs only)."""
    top = body.get("top_logprobs", int)
    if not body.get("logprobs", bool, False):
        if top:
            raise RequestError("'top_logprobs' needs 'logprobs' = true", field="top_logprobs")
        return None, "top_logprobs"
    return (top or 0), "top_logprobs"


def _reasoning_effort(body: Fields) -> Thinking | None:
    effort = body.get("reasoning_effort", str)
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise RequestError(f"'reasoning_effort' = {json.dumps(effort)[:40]} should be one of "
                           f"{', '.join(REASONING_EFFORTS)}", field="reasoning_effort")
    return Thinking(effort not in ("none", "minimal"), "reasoning_effort", effort=effort)


def _anthropic_thinking(body: Fields) -> Thinking | None:
    """Anthropic's thinking: {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}."""
    raw = body.get("thinking", dict)
    if raw is None:
        return None
    thinking = Fields(raw, "thinking.")
    kind = thinking.get("type", str, required=True)
    if kind == "disabled":
        return Thinking(False, "thinking")
    if kind != "enabled":
        raise RequestError(f"'thinking.type' = {json.dumps(kind)[:40]} should be enabled or "
                           "disabled", field="thinking.type")
    budget = thinking.get("budget_tokens", int, required=True)
    if budget < 1:
        raise RequestError(f"'thinking.budget_tokens' = {budget} should be at least 1",
                           field="thinking.budget_tokens")
    return Thinking(True, "thinking", budget=budget)


def _text_content(content: Any, param: str, parts_type: str = "text") -> str:
    """A message's content as one string: a string, or an array of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{param}' should be a string or an array of content parts",
                           field=param)
    texts = []
    for i, part in enumerate(content):
        part = Fields(part, f"{param}[{i}].")
        kind = part.get("type", str, required=True)
        if kind != parts_type:
            raise RequestError(f"'{param}[{i}].type' = {kind!r} is not supported (only "
                               f"{parts_type!r} parts)", field=f"{param}[{i}].type")
        texts.append(part.get("text", str, required=True))
    return "".join(texts)


def _openai_tools(body: Fields) -> list[dict] | None:
    tools = _list(body, "tools", MAX_TOOLS)
    choice = body.get("tool_choice", (str, dict), "auto")
    if choice not in ("auto", "none"):
        raise RequestError(f"'tool_choice' = {json.dumps(choice)} is not supported (auto, "
                           "none): the engine does not constrain decoding", field="tool_choice")
    if not tools or choice == "none":
        return None
    for i, tool in enumerate(tools):
        tool = Fields(tool, f"tools[{i}].")
        if tool.get("type", str, "function") != "function":
            raise RequestError(f"'tools[{i}].type' should be 'function'", field=f"tools[{i}].type")
        Fields(tool.get("function", dict, required=True), f"tools[{i}].function.").get(
            "name", str, required=True)
    return tools


def _openai_message(raw: Any, i: int) -> dict:
    msg = Fields(raw, f"messages[{i}].")
    role = msg.get("role", str, required=True)
    if role not in ROLES:
        raise RequestError(f"'messages[{i}].role' = {role!r} should be one of "
                           f"{', '.join(ROLES)}", field=f"messages[{i}].role")
    out = {"role": "system" if role == "developer" else role}
    tool_calls = msg.get("tool_calls", list) if role == "assistant" else None
    content = msg.raw.get("content")
    if content is None and not tool_calls:
        raise RequestError(f"'messages[{i}].content' is required", field=f"messages[{i}].content")
    out["content"] = "" if content is None else _text_content(content, f"messages[{i}].content")
    if role == "tool":
        out["tool_call_id"] = msg.get("tool_call_id", str, required=True)
    if tool_calls:
        out["tool_calls"] = []
        for j, call in enumerate(tool_calls):
            call = Fields(call, f"messages[{i}].tool_calls[{j}].")
            fn = Fields(call.get("function", dict, required=True), f"{call.where}function.")
            out["tool_calls"].append({
                "id": call.get("id", str, ""), "type": "function",
                "function": {"name": fn.get("name", str, required=True),
                             "arguments": fn.get("arguments", str, "{}")}})
    reasoning = msg.get("reasoning_content", str) if role == "assistant" else None
    if reasoning:
        out["reasoning_content"] = reasoning
    return out


def _template_kwargs(body: Fields) -> dict:
    kwargs = body.get("chat_template_kwargs", dict, {})
    for name, why in RESERVED_TEMPLATE_KWARGS.items():
        if name in kwargs:
            raise RequestError(f"'chat_template_kwargs.{name}' is {why}",
                               field=f"chat_template_kwargs.{name}")
    return kwargs


def _messages(body: Fields) -> list:
    messages = _list(body, "messages", MAX_MESSAGES, required=True)
    if not messages:
        raise RequestError("'messages' should not be empty", field="messages")
    return messages


def parse_chat(body: Fields) -> ChatInput:
    refuse_unsupported(body, "chat")
    messages = _messages(body)
    kwargs = _template_kwargs(body)
    stream = body.get("stream", bool, False)
    response_format = Fields(body.get("response_format", dict, {}), "response_format.")
    if response_format.get("type", str, "text") != "text":
        raise RequestError("'response_format.type' = "
                           f"{response_format.raw['type']!r} is not supported (text): the engine "
                           "does not constrain decoding", field="response_format.type")
    continue_final = body.get("continue_final_message", bool, False)
    if continue_final and Fields(messages[-1], f"messages[{len(messages) - 1}].").get(
            "role", str) != "assistant":
        raise RequestError("'continue_final_message' needs an assistant message last",
                           field="continue_final_message")
    return ChatInput(
        model=body.get("model", str, required=True),
        messages=[_openai_message(m, i) for i, m in enumerate(messages)],
        tools=_openai_tools(body), template_kwargs=kwargs,
        options=_options(body, _max_tokens(body, "max_completion_tokens", "max_tokens"),
                         _stop(body, "stop"), _chat_logprobs(body), _n(body)),
        stream=stream, include_usage=_include_usage(body, stream),
        thinking=_reasoning_effort(body), continue_final=continue_final)


def parse_completion(body: Fields) -> CompletionInput:
    refuse_unsupported(body, "completion")
    prompt = body.get("prompt", (str, list), required=True)
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        elif not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError("'prompt' should be a string, or one array of token ids",
                               field="prompt")
    stream = body.get("stream", bool, False)
    return CompletionInput(
        model=body.get("model", str, required=True), prompt=prompt,
        options=_options(body, _max_tokens(body, "max_tokens"), _stop(body, "stop"),
                         (body.get("logprobs", int), "logprobs"), _n(body)),
        stream=stream, include_usage=_include_usage(body, stream))


# ---------------------------------------------------------------------------------------------
# Anthropic Messages


def _anthropic_blocks(content: Any, param: str) -> list[Fields]:
    if isinstance(content, str):
        return [Fields({"type": "text", "text": content}, f"{param}[0].")]
    if not isinstance(content, list):
        raise RequestError(f"'{param}' should be a string or an array of content blocks",
                           field=param)
    return [Fields(block, f"{param}[{j}].") for j, block in enumerate(content)]


def _anthropic_messages(system: Any, messages: list) -> list[dict]:
    """Anthropic turns as OpenAI-shaped messages: tool_use blocks become assistant tool_calls,
    tool_result blocks become role "tool" messages, thinking blocks become reasoning_content."""
    out = [{"role": "system", "content": _text_content(system, "system")}] if system else []
    for i, raw in enumerate(messages):
        msg = Fields(raw, f"messages[{i}].")
        role = msg.get("role", str, required=True)
        if role not in ("user", "assistant"):
            raise RequestError(f"'messages[{i}].role' = {role!r} should be user or assistant",
                               field=f"messages[{i}].role")
        text, reasoning, calls = [], [], []
        for block in _anthropic_blocks(msg.raw.get("content"), f"messages[{i}].content"):
            kind = block.get("type", str, required=True)
            if kind == "text":
                text.append(block.get("text", str, required=True))
            elif kind == "thinking" and role == "assistant":
                reasoning.append(block.get("thinking", str, ""))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": block.get("id", str, required=True), "type": "function",
                              "function": {"name": block.get("name", str, required=True),
                                           "arguments": json.dumps(block.get("input", dict, {}),
                                                                   ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                result = block.raw.get("content", "")
                call_id = block.get("tool_use_id", str, required=True)
                out.append({"role": "tool", "tool_call_id": call_id,
                            "content": _text_content(result, block.where + "content")})
            elif kind != "redacted_thinking":
                raise RequestError(f"'{block.where}type' = {kind!r} is not supported in a "
                                   f"{role} message", field=block.where + "type")
        if text or calls or reasoning or role == "assistant":
            message = {"role": role, "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
            if reasoning:
                message["reasoning_content"] = "".join(reasoning)
            out.append(message)
    return out


def _anthropic_tools(body: Fields) -> list[dict] | None:
    tools = _list(body, "tools", MAX_TOOLS)
    choice = Fields(body.get("tool_choice", dict, {"type": "auto"}), "tool_choice.")
    kind = choice.get("type", str, required=True)
    if kind not in ("auto", "none"):
        raise RequestError(f"'tool_choice.type' = {kind!r} is not supported (auto, none): the "
                           "engine does not constrain decoding", field="tool_choice.type")
    if not tools or kind == "none":
        return None
    out = []
    for i, tool in enumerate(tools):
        tool = Fields(tool, f"tools[{i}].")
        out.append({"type": "function", "function": {
            "name": tool.get("name", str, required=True),
            "description": tool.get("description", str, ""),
            "parameters": tool.get("input_schema", dict, {"type": "object"})}})
    return out


def parse_messages(body: Fields, count_only: bool = False) -> ChatInput:
    """A Messages request; `count_only` (POST /v1/messages/count_tokens) needs no max_tokens."""
    refuse_unsupported(body, "messages")
    messages = _anthropic_messages(body.get("system", (str, list)), _messages(body))
    return ChatInput(
        model=body.get("model", str, required=True), messages=messages,
        tools=_anthropic_tools(body), template_kwargs=_template_kwargs(body),
        options=_options(body, _max_tokens(body, "max_tokens", required=not count_only),
                         _stop(body, "stop_sequences")),
        stream=body.get("stream", bool, False), thinking=_anthropic_thinking(body),
        continue_final=bool(messages) and messages[-1]["role"] == "assistant")  # a prefill
