"""gpt-oss's harmony replies -> reasoning, content and tool calls.

A harmony reply is a run of messages, each a header and a body:
`<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY`, ended by `<|end|>` (the
next message follows from `<|start|>assistant`), `<|call|>` or `<|return|>` (the turn ends: these
are end-of-turn tokens, so the engine stops before them and the parser sees the text end). The
prompt ends with the first message's `<|start|>assistant`. A recipient may also follow the role
(`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`, as the chat template
writes calls back). The analysis channel is reasoning; final, and commentary that names no
recipient (a preamble), are content; a message to `functions.NAME` is a call of tool NAME whose
body is its JSON arguments.
"""

from __future__ import annotations

import dataclasses
import re

from tidejax.text.toolcalls import ToolCall, json_object

_HEADER_END = "<|message|>"
_MESSAGE_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_FUNCTIONS = "functions."  # the namespace the template declares the request's tools in


class HarmonyParser:
    """Splits a harmony reply into ("reasoning" | "content", text) pieces as it arrives (the
    OutputParser interface): a header is held until its `<|message|>`, a body streams but for
    the few characters that might start an end marker, and a call's body is held and parsed by
    `finish()` (calls are read only where the request offered tools)."""

    def __init__(self, tools: list[dict] | None):
        self.tools = tools
        self.header: str | None = ""  # the header being read; None inside a body
        self.kind = "content"  # the body's: "reasoning", "content" or "call"
        self.pending = ""
        self.calls: list[list[str]] = []  # [recipient, raw text, body] of each call message
        self.tool_calls: list[ToolCall] = []  # set by finish()

    def _open(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if self.tools and recipient and recipient.group(1).startswith(_FUNCTIONS):
            self.kind = "call"
            self.calls.append([recipient.group(1), header + _HEADER_END, ""])
        else:
            self.kind = "reasoning" if channel and channel.group(1) == "analysis" else "content"

    def _body(self, text: str) -> list[tuple[str, str]]:
        if self.kind != "call":
            return [(self.kind, text)]
        self.calls[-1][1] += text
        self.calls[-1][2] += text
        return []

    def feed(self, text: str) -> list[tuple[str, str]]:
        out = []
        self.pending += text
        while self.pending:
            if self.header is not None:
                self.header, self.pending = self.header + self.pending, ""
                at = self.header.find(_HEADER_END)
                if at < 0:
                    break
                self._open(self.header[:at])
                self.header, self.pending = None, self.header[at + len(_HEADER_END):]
                continue
            found = [(i, m) for m in _MESSAGE_ENDS if (i := self.pending.find(m)) >= 0]
            if found:
                at, marker = min(found)
                out += self._body(self.pending[:at])
                # <|start|> opens the next header; the other markers end the message
                self.pending = self.pending[at + (0 if marker == "<|start|>" else len(marker)):]
                self.header, self.kind = "", "content"
                continue
            hold = max((k for m in _MESSAGE_ENDS for k in range(1, len(m))
                        if self.pending.endswith(m[:k])), default=0)
            out += self._body(self.pending[:len(self.pending) - hold])
            self.pending = self.pending[len(self.pending) - hold:]
            break
        return [(kind, t) for kind, t in out if t]

    def finish(self) -> list[tuple[str, str]]:
        """The held text (an unfinished header is content: text outside any message); the
        parsed calls go to `tool_calls`, a call whose arguments are not a JSON object is
        content as written."""
        if self.header is None:
            out = self._body(self.pending)
        else:  # pending is empty
            out = [("content", self.header)] if self.header.strip() else []
        self.header, self.pending = "", ""
        calls, self.calls = self.calls, []
        for recipient, raw, body in calls:
            arguments = json_object(body)
            if arguments is None:
                out.append(("content", raw))
            else:
                self.tool_calls.append(ToolCall(recipient.removeprefix(_FUNCTIONS), arguments))
        return [(kind, t) for kind, t in out if t]


@dataclasses.dataclass(frozen=True)
class HarmonyFormat:
    """gpt-oss's reply format, in the role of a text.toolcalls.ToolFormat: its template is known
    by `template_marker`; the server keeps `tokens` in the text it parses, hands the template a
    call's arguments as a mapping (it writes them with tojson) and the earlier reasoning as
    `thinking`, and takes the efforts of its system line's "Reasoning: ..."."""

    name: str = "harmony"
    template_marker: str = "<|channel|>"
    tokens: tuple[str, ...] = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>",
                               "<|end|>", "<|call|>", "<|return|>")
    arguments_as_dict: bool = True
    reasoning_key: str = "thinking"
    efforts: tuple[str, ...] = ("low", "medium", "high")

    def parser(self, in_reasoning: bool, tools: list[dict] | None) -> HarmonyParser:
        return HarmonyParser(tools)  # the channels say what is reasoning, not the prompt


HARMONY = HarmonyFormat()
