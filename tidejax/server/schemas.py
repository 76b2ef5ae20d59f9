"""Request schemas: the JSON bodies of the OpenAI and Anthropic routes, checked field by field
and turned into one internal shape (`ChatInput` / `CompletionInput`). Every problem raises an
`APIError(400)` that names the field."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tidejax.runtime.sampling import SamplingParams
from tidejax.server.errors import APIError

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class GenerationOptions:
    """A request's generation fields: the engine's sampling as is, plus the token budget and the
    stop strings the server applies."""

    sampling: SamplingParams
    max_tokens: int | None  # None: up to the context or the server's limit
    max_tokens_param: str = "max_tokens"  # the request field that set it, for error messages
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks)


@dataclasses.dataclass(frozen=True)
class ChatInput:
    model: str
    messages: list[dict]  # OpenAI-shaped messages, content as strings
    tools: list[dict] | None  # OpenAI function tools, None when none may be called
    template_kwargs: dict
    options: GenerationOptions
    stream: bool


@dataclasses.dataclass(frozen=True)
class CompletionInput:
    model: str
    prompt: str | list[int]
    options: GenerationOptions
    stream: bool


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "an array", dict: "an object"}


class Fields:
    """Typed access to a JSON object; `where` prefixes field names in errors (`messages[2].`)."""

    def __init__(self, raw: Any, where: str = ""):
        if not isinstance(raw, dict):
            raise APIError(400, f"{where.rstrip('.') or 'body'} should be a JSON object",
                           param=where.rstrip(".") or None)
        self.raw, self.where = raw, where

    def get(self, name: str, kind: type | tuple, default: Any = None, required: bool = False):
        param = self.where + name
        value = self.raw.get(name)
        if value is None:
            if required:
                raise APIError(400, f"'{param}' is required", param=param)
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(_TYPE_NAMES[k] for k in kinds)
            raise APIError(400, f"'{param}' should be {names}, got {json.dumps(value)[:80]}",
                           param=param)
        return value

    def number(self, name: str, default: float, low: float, high: float,
               low_open: bool = False) -> float:
        value = self.get(name, float, default)
        if value < low or value > high or (low_open and value == low):
            bracket = "(" if low_open else "["
            raise APIError(400, f"'{self.where + name}' = {value} is out of range "
                                f"{bracket}{low}, {high}]", param=self.where + name)
        return value


def parse_json(text: bytes) -> Fields:
    try:
        return Fields(json.loads(text))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None


def _max_tokens(body: Fields, *names: str, required: bool = False) -> tuple[int | None, str]:
    """The first of `names` present (chat takes max_completion_tokens or max_tokens) and its
    name."""
    for name in names:
        value = body.get(name, int)
        if value is not None:
            if value < 1:
                raise APIError(400, f"'{name}' = {value} should be at least 1", param=name)
            return value, name
    if required:
        raise APIError(400, f"'{names[0]}' is required", param=names[0])
    return None, names[-1]


def _stop(body: Fields, name: str) -> tuple[str, ...]:
    stop = body.get(name, (str, list), ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"'{name}' should be a string or an array of non-empty strings",
                       param=name)
    return stop


def _options(body: Fields, max_tokens: tuple[int | None, str],
             stop: tuple[str, ...]) -> GenerationOptions:
    top_k = body.get("top_k", int, 0)
    if top_k < -1:
        raise APIError(400, f"'top_k' = {top_k} should be -1 or 0 (off) or positive",
                       param="top_k")
    n = body.get("n", int, 1)
    if n != 1:
        raise APIError(400, f"'n' = {n}: only one choice per request is supported", param="n")
    sampling = SamplingParams(temperature=body.number("temperature", 1.0, 0.0, 2.0),
                              top_p=body.number("top_p", 1.0, 0.0, 1.0, low_open=True),
                              top_k=max(top_k, 0), seed=body.get("seed", int))
    return GenerationOptions(sampling, max_tokens=max_tokens[0], max_tokens_param=max_tokens[1],
                             stop=stop, ignore_eos=body.get("ignore_eos", bool, False))


def _text_content(content: Any, param: str, parts_type: str = "text") -> str:
    """A message's content as one string: a string, or an array of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"'{param}' should be a string or an array of content parts",
                       param=param)
    texts = []
    for i, part in enumerate(content):
        part = Fields(part, f"{param}[{i}].")
        kind = part.get("type", str, required=True)
        if kind != parts_type:
            raise APIError(400, f"'{param}[{i}].type' = {kind!r} is not supported (only "
                                f"{parts_type!r} parts)", param=f"{param}[{i}].type")
        texts.append(part.get("text", str, required=True))
    return "".join(texts)


def _openai_tools(body: Fields) -> list[dict] | None:
    tools = body.get("tools", list)
    choice = body.get("tool_choice", (str, dict), "auto")
    if choice not in ("auto", "none"):
        raise APIError(400, f"'tool_choice' = {json.dumps(choice)} is not supported (auto, "
                            "none): the engine does not constrain decoding", param="tool_choice")
    if not tools or choice == "none":
        return None
    for i, tool in enumerate(tools):
        tool = Fields(tool, f"tools[{i}].")
        if tool.get("type", str, "function") != "function":
            raise APIError(400, f"'tools[{i}].type' should be 'function'", param=f"tools[{i}].type")
        Fields(tool.get("function", dict, required=True), f"tools[{i}].function.").get(
            "name", str, required=True)
    return tools


def _openai_message(raw: Any, i: int) -> dict:
    msg = Fields(raw, f"messages[{i}].")
    role = msg.get("role", str, required=True)
    if role not in ROLES:
        raise APIError(400, f"'messages[{i}].role' = {role!r} should be one of "
                            f"{', '.join(ROLES)}", param=f"messages[{i}].role")
    out = {"role": "system" if role == "developer" else role}
    tool_calls = msg.get("tool_calls", list) if role == "assistant" else None
    content = msg.raw.get("content")
    if content is None and not tool_calls:
        raise APIError(400, f"'messages[{i}].content' is required", param=f"messages[{i}].content")
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


def parse_chat(body: Fields) -> ChatInput:
    messages = body.get("messages", list, required=True)
    if not messages:
        raise APIError(400, "'messages' should not be empty", param="messages")
    kwargs = body.get("chat_template_kwargs", dict, {})
    response_format = Fields(body.get("response_format", dict, {}), "response_format.")
    if response_format.get("type", str, "text") != "text":
        raise APIError(400, "'response_format.type' = "
                            f"{response_format.raw['type']!r} is not supported (text): the engine "
                            "does not constrain decoding", param="response_format.type")
    if body.raw.get("logprobs") or body.raw.get("top_logprobs"):
        raise APIError(400, "'logprobs' is not supported", param="logprobs")
    return ChatInput(
        model=body.get("model", str, required=True),
        messages=[_openai_message(m, i) for i, m in enumerate(messages)],
        tools=_openai_tools(body), template_kwargs=kwargs,
        options=_options(body, _max_tokens(body, "max_completion_tokens", "max_tokens"),
                         _stop(body, "stop")),
        stream=body.get("stream", bool, False))


def parse_completion(body: Fields) -> CompletionInput:
    prompt = body.get("prompt", (str, list), required=True)
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        elif not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise APIError(400, "'prompt' should be a string, or one array of token ids",
                           param="prompt")
    for name in ("logprobs", "suffix", "echo", "best_of"):
        if body.raw.get(name) not in (None, False, 1 if name == "best_of" else None):
            raise APIError(400, f"'{name}' is not supported", param=name)
    return CompletionInput(
        model=body.get("model", str, required=True), prompt=prompt,
        options=_options(body, _max_tokens(body, "max_tokens"), _stop(body, "stop")),
        stream=body.get("stream", bool, False))


# ---------------------------------------------------------------------------------------------
# Anthropic Messages


def _anthropic_blocks(content: Any, param: str) -> list[Fields]:
    if isinstance(content, str):
        return [Fields({"type": "text", "text": content}, f"{param}[0].")]
    if not isinstance(content, list):
        raise APIError(400, f"'{param}' should be a string or an array of content blocks",
                       param=param)
    return [Fields(block, f"{param}[{j}].") for j, block in enumerate(content)]


def _anthropic_messages(system: Any, messages: list) -> list[dict]:
    """Anthropic turns as OpenAI-shaped messages: tool_use blocks become assistant tool_calls,
    tool_result blocks become role "tool" messages, thinking blocks become reasoning_content."""
    out = [{"role": "system", "content": _text_content(system, "system")}] if system else []
    for i, raw in enumerate(messages):
        msg = Fields(raw, f"messages[{i}].")
        role = msg.get("role", str, required=True)
        if role not in ("user", "assistant"):
            raise APIError(400, f"'messages[{i}].role' = {role!r} should be user or assistant",
                           param=f"messages[{i}].role")
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
                raise APIError(400, f"'{block.where}type' = {kind!r} is not supported in a "
                                    f"{role} message", param=block.where + "type")
        if text or calls or reasoning or role == "assistant":
            message = {"role": role, "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
            if reasoning:
                message["reasoning_content"] = "".join(reasoning)
            out.append(message)
    return out


def _anthropic_tools(body: Fields) -> list[dict] | None:
    tools = body.get("tools", list)
    choice = Fields(body.get("tool_choice", dict, {"type": "auto"}), "tool_choice.")
    kind = choice.get("type", str, required=True)
    if kind not in ("auto", "none"):
        raise APIError(400, f"'tool_choice.type' = {kind!r} is not supported (auto, none): the "
                            "engine does not constrain decoding", param="tool_choice.type")
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
    messages = body.get("messages", list, required=True)
    if not messages:
        raise APIError(400, "'messages' should not be empty", param="messages")
    thinking = Fields(body.get("thinking", dict, {}), "thinking.").get("type", str)
    kwargs = {} if thinking is None else {"thinking": thinking == "enabled",
                                          "enable_thinking": thinking == "enabled"}
    return ChatInput(
        model=body.get("model", str, required=True),
        messages=_anthropic_messages(body.get("system", (str, list)), messages),
        tools=_anthropic_tools(body), template_kwargs=kwargs,
        options=_options(body, _max_tokens(body, "max_tokens", required=not count_only),
                         _stop(body, "stop_sequences")),
        stream=body.get("stream", bool, False))
