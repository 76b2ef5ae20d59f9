"""Model output -> reasoning, content and tool calls.

Each model family writes tool calls in its own format; one `ToolFormat` per format parses them,
and the engine client names the served model's (`EngineInfo.tool_format`). `OutputParser`
splits a stream of text into `<think>` reasoning, visible content and the tool-call section,
holding back only the few characters that might be the start of a marker. (gpt-oss's replies
are harmony messages, not one text with tags: text/harmony.py.)
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Callable


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = dataclasses.field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


_NOT_JSON = object()


def _loads(text: str):
    """`text` parsed, else _NOT_JSON: the model may write anything, an integer longer than Python
    reads or nesting past its recursion limit too."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # json.JSONDecodeError is a ValueError
        return _NOT_JSON


def json_object(text: str) -> str | None:
    """`text` as compact JSON if it is a JSON object, else None."""
    value = _loads(text)
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def parameter_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """OpenAI function tools -> {tool name: {argument: its JSON schema}}."""
    schemas = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties")
        if isinstance(function.get("name"), str) and isinstance(properties, dict):
            schemas[function["name"]] = properties
    return schemas


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """One way of writing tool calls. `start` opens the tool-call section in the output;
    `template_marker` identifies the format in a chat template; `arguments_as_dict` says whether
    the template reads an assistant tool call's arguments as a mapping (else as a JSON string);
    `tokens`: the control tokens a call holds besides those naming a tool (the text the parser
    reads keeps them). `parse_calls(body, schemas)` reads the calls of one match of
    `call_pattern` (one call, or Mistral's list of them); `schemas` (`parameter_schemas` of the
    request's tools) types arguments a format writes untyped.
    `reasoning_key`: the assistant message field the template reads earlier reasoning from;
    `efforts`: the reasoning_effort values the template takes (None: any it reads)."""

    name: str
    start: str
    template_marker: str
    call_pattern: re.Pattern  # group 1: the body of one call (or of one list of calls)
    parse_calls: Callable[[str, dict[str, dict]], list[ToolCall] | None]
    arguments_as_dict: bool
    tokens: tuple[str, ...] = ()
    reasoning_key: str = "reasoning_content"
    efforts: tuple[str, ...] | None = None

    def parser(self, in_reasoning: bool, tools: list[dict] | None) -> "OutputParser":
        """The parser of one reply; the tool-call section is read only where tools were
        offered."""
        return OutputParser(self if tools else None, in_reasoning, tools)

    def parse(self, section: str, tools: list[dict] | None = None) -> list[ToolCall] | None:
        """The calls in a tool-call section (arguments typed by the request's `tools` where the
        format needs it), or None when any call in it is malformed."""
        schemas = parameter_schemas(tools)
        calls = []
        for match in self.call_pattern.finditer(section):
            found = self.parse_calls(match.group(1), schemas)
            if found is None:
                return None
            calls += found
        return calls or None


def _one(parse_call: Callable[[str, dict[str, dict]], ToolCall | None]) -> Callable:
    """`parse_calls` of a format whose call_pattern matches one call at a time."""
    def parse_calls(body: str, schemas: dict[str, dict]) -> list[ToolCall] | None:
        call = parse_call(body, schemas)
        return None if call is None else [call]
    return parse_calls


def _call_deepseek_v3(body: str) -> ToolCall | None:
    # V3/R1: "function<｜tool▁sep｜>NAME\n```json\nARGS\n```"; V3.1: "NAME<｜tool▁sep｜>ARGS"
    head, sep, rest = body.partition("<｜tool▁sep｜>")
    if not sep:
        return None
    fenced = re.fullmatch(r"\s*([^\n]+)\n```(?:json)?\n(.*?)\n```\s*", rest, re.S)
    name, args = (fenced.group(1), fenced.group(2)) if fenced else (head, rest)
    args = json_object(args)
    return ToolCall(name.strip(), args) if args is not None and name.strip() else None


_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _call_glm(body: str, schemas: dict[str, dict]) -> ToolCall | None:
    # "NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>...": V typed by the tool's schema
    name, sep, rest = body.partition("<arg_key>")
    name, rest = name.strip(), sep + rest
    if not name or _GLM_ARGUMENT.sub("", rest).strip():  # no name, or a broken argument
        return None
    return _typed_call(name, _GLM_ARGUMENT.findall(rest), schemas)


def _typed_call(name: str, pairs: list[tuple[str, str]], schemas: dict[str, dict]) -> ToolCall:
    """A call from (argument, value text) pairs of a format that writes a string value as it is
    and anything else as JSON (GLM's, MiniMax-M2's): the value stays text where the tool's
    schema says string, else it is parsed as JSON where it parses."""
    properties = schemas.get(name, {})
    arguments = {}
    for key, value in pairs:
        key = key.strip()
        parsed = _NOT_JSON if _is_string(properties.get(key)) else _loads(value)
        arguments[key] = value if parsed is _NOT_JSON else parsed
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


_MINIMAX_PARAMETER = re.compile(r'<parameter name="([^"]*)">(.*?)</parameter>', re.S)


def _call_minimax_m2(body: str, schemas: dict[str, dict]) -> ToolCall | None:
    # '"NAME">\n<parameter name="K">V</parameter>\n...' (the inside of one <invoke name=...>):
    # V typed by the tool's schema
    name, sep, rest = body.partition(">")
    name = name.strip().strip('"')
    if not sep or not name or _MINIMAX_PARAMETER.sub("", rest).strip():
        return None
    return _typed_call(name, _MINIMAX_PARAMETER.findall(rest), schemas)


def _is_string(schema) -> bool:
    """Whether a JSON schema's type is string (or a list of types that holds string)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _call_kimi_k2(body: str) -> ToolCall | None:
    # "functions.NAME:IDX<|tool_call_argument_begin|>ARGS"; the template writes the call's id
    # (functions.NAME:IDX) back into the history and names the tool result by it, so it is kept
    head, sep, args = body.partition("<|tool_call_argument_begin|>")
    head = head.strip()
    stem, colon, index = head.rpartition(":")
    indexed = bool(colon) and index.isdigit()
    name = (stem if indexed else head).removeprefix("functions.")
    args = json_object(args)
    if not sep or args is None or not name:
        return None
    return ToolCall(name, args, head) if indexed else ToolCall(name, args)


def _call_hermes(body: str) -> ToolCall | None:
    # {"name": NAME, "arguments": {...}}
    return _named_call(_loads(body))


def _named_call(value) -> ToolCall | None:
    """A call from a parsed {"name": NAME, "arguments": {...}} (or "parameters"; the arguments
    an object or its JSON text), else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _calls_mistral(body: str) -> list[ToolCall] | None:
    # ' [{"name": NAME, "arguments": {...}, "id": ID}, ...]' (Mistral's v3 tokenizer: Mixtral);
    # its template refuses a call in the history whose id is not 9 letters or digits, so a call
    # keeps such an id where the model wrote one and is given one where it did not
    value = _loads(body)
    if not isinstance(value, list):
        return None
    calls = []
    for item in value:
        call = _named_call(item)
        if call is None:
            return None
        written = item.get("id")
        keep = isinstance(written, str) and _MISTRAL_ID.fullmatch(written)
        calls.append(ToolCall(call.name, call.arguments,
                              written if keep else uuid.uuid4().hex[:9]))
    return calls or None


DEEPSEEK_V3 = ToolFormat(
    name="deepseek_v3", start="<｜tool▁calls▁begin｜>", template_marker="tool▁calls▁begin",
    call_pattern=re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>", re.S),
    parse_calls=_one(lambda body, _: _call_deepseek_v3(body)), arguments_as_dict=False)
GLM = ToolFormat(
    name="glm", start="<tool_call>", template_marker="<arg_key>",
    call_pattern=re.compile(r"<tool_call>(.*?)</tool_call>", re.S),
    parse_calls=_one(_call_glm),
    arguments_as_dict=True, tokens=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"))
KIMI_K2 = ToolFormat(
    name="kimi_k2", start="<|tool_calls_section_begin|>", template_marker="<|tool_call_begin|>",
    call_pattern=re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_end\|>", re.S),
    parse_calls=_one(lambda body, _: _call_kimi_k2(body)), arguments_as_dict=False)
MINIMAX_M2 = ToolFormat(
    name="minimax_m2", start="<minimax:tool_call>", template_marker="<minimax:tool_call>",
    call_pattern=re.compile(r"<invoke name=(.*?)</invoke>", re.S),
    parse_calls=_one(_call_minimax_m2),
    arguments_as_dict=True)
HERMES = ToolFormat(
    name="hermes", start="<tool_call>", template_marker="<tool_call>",
    call_pattern=re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S),
    parse_calls=_one(lambda body, _: _call_hermes(body)),
    arguments_as_dict=True)
MISTRAL = ToolFormat(
    name="mistral", start="[TOOL_CALLS]", template_marker="[TOOL_CALLS]",
    call_pattern=re.compile(r"\[TOOL_CALLS\]((?:(?!\[TOOL_CALLS\]).)*)", re.S),
    parse_calls=lambda body, _: _calls_mistral(body), arguments_as_dict=True)

# most specific template marker first: GLM's templates also contain "<tool_call>"
TOOL_FORMATS = (DEEPSEEK_V3, KIMI_K2, GLM, MINIMAX_M2, MISTRAL, HERMES)


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def starts_in_reasoning(prompt: str) -> bool:
    """Templates that switch thinking on end the prompt with an open `<think>`."""
    return prompt.rstrip().endswith(THINK_OPEN)


class OutputParser:
    """Splits generated text into ("reasoning" | "content", text) pieces as it arrives; the
    tool-call section (from the format's start marker on) is held and parsed by `finish()`."""

    def __init__(self, tool_format: ToolFormat | None, in_reasoning: bool = False,
                 tools: list[dict] | None = None):
        self.tool_format = tool_format
        self.tools = tools  # the request's tools: they type the arguments of some formats
        self.mode = "reasoning" if in_reasoning else "content"
        self.pending = ""
        self.tool_text = ""
        self.tool_calls: list[ToolCall] = []  # set by finish()

    def _markers(self) -> dict[str, str]:
        if self.mode == "reasoning":
            return {THINK_CLOSE: "content"}
        markers = {THINK_OPEN: "reasoning"}
        if self.tool_format is not None:
            markers[self.tool_format.start] = "tools"
        return markers

    def feed(self, text: str) -> list[tuple[str, str]]:
        out = []
        self.pending += text
        while self.pending:
            if self.mode == "tools":
                self.tool_text += self.pending
                self.pending = ""
                break
            markers = self._markers()
            found = [(i, m) for m in markers if (i := self.pending.find(m)) >= 0]
            if found:
                i, marker = min(found)
                out.append((self.mode, self.pending[:i]))
                self.mode = markers[marker]
                self.pending = self.pending[i + len(marker):]
                if self.mode == "tools":
                    self.tool_text = marker
                continue
            hold = max((k for m in markers for k in range(1, len(m))
                        if self.pending.endswith(m[:k])), default=0)
            out.append((self.mode, self.pending[:len(self.pending) - hold]))
            self.pending = self.pending[len(self.pending) - hold:]
            break
        return [(kind, t) for kind, t in out if t]

    def finish(self) -> list[tuple[str, str]]:
        """The held text; the parsed tool calls go to `tool_calls` (a section that does not
        parse is content)."""
        out = [(self.mode, self.pending)] if self.pending and self.mode != "tools" else []
        if self.tool_text:
            self.tool_calls = self.tool_format.parse(self.tool_text, self.tools) or []
            if not self.tool_calls:
                out.append(("content", self.tool_text))
        self.pending = self.tool_text = ""
        return [(kind, t) for kind, t in out if t]
