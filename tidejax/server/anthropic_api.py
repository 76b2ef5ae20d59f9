"""Anthropic Messages route: POST /v1/messages, non-streaming or as Anthropic streams it
(message_start, content_block_start, ping, content_block_delta..., content_block_stop,
message_delta, message_stop). Reasoning comes back as `thinking` blocks and tool calls as
`tool_use` blocks."""

from __future__ import annotations

import contextlib
import json
import re

from aiohttp import web

from tidejax.server.generation import Generation, output_pieces
from tidejax.server.sse import SSE
from tidejax.text.toolcalls import OutputParser, ToolCall

_BLOCKS = {  # parser piece kind -> (empty block, delta type, delta field)
    "reasoning": ({"type": "thinking", "thinking": "", "signature": ""}, "thinking_delta",
                  "thinking"),
    "content": ({"type": "text", "text": ""}, "text_delta", "text"),
}


def _tool_use(call: ToolCall, input_value: dict | None = None) -> dict:
    # Anthropic ids are [A-Za-z0-9_-]+; a format's own ids (Kimi K2's functions.NAME:IDX) are not
    tool_id = "toolu_" + re.sub(r"[^A-Za-z0-9_-]", "_", call.id.removeprefix("call_"))
    return {"type": "tool_use", "id": tool_id, "name": call.name,
            "input": json.loads(call.arguments) if input_value is None else input_value}


def _stop_reason(gen: Generation, calls: list[ToolCall]) -> str:
    if calls:
        return "tool_use"
    if gen.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if gen.stop_string is not None else "end_turn"


def _usage(gen: Generation) -> dict:
    """Anthropic's split of the prompt: `input_tokens` prefilled, `cache_read_input_tokens` read
    from the prompt cache (their sum is the prompt)."""
    return {"input_tokens": gen.prompt_tokens - gen.cached_tokens,
            "cache_read_input_tokens": gen.cached_tokens, "output_tokens": gen.completion_tokens}


async def message(request: web.Request, gen: Generation, parser: OutputParser,
                  stream: bool) -> web.StreamResponse:
    head = {"id": gen.id, "type": "message", "role": "assistant", "model": gen.model.name}
    if not stream:
        blocks: list[dict] = []

        def add(kind: str, text: str) -> None:
            empty, _, field = _BLOCKS[kind]
            if not blocks or blocks[-1]["type"] != empty["type"]:
                blocks.append(dict(empty))
            blocks[-1][field] += text

        async with contextlib.aclosing(output_pieces(gen, parser)) as output:
            async for kind, piece, _ in output:
                add(kind, piece)
        calls = parser.tool_calls
        blocks += [_tool_use(c) for c in calls]
        return web.json_response({
            **head, "content": blocks or [{"type": "text", "text": ""}],
            "stop_reason": _stop_reason(gen, calls), "stop_sequence": gen.stop_string,
            "usage": _usage(gen), "x_engine_stats": gen.engine_stats})

    sse = SSE(request)
    await sse.start()
    await sse.send({"type": "message_start", "message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": 0}}}, "message_start")
    index, open_kind = -1, None

    async def start_block(block: dict) -> None:
        nonlocal index
        index += 1
        await sse.send({"type": "content_block_start", "index": index, "content_block": block},
                       "content_block_start")
        if index == 0:
            await sse.send({"type": "ping"}, "ping")

    async def stop_block() -> None:
        await sse.send({"type": "content_block_stop", "index": index}, "content_block_stop")

    async def piece(kind: str, text: str) -> None:
        nonlocal open_kind
        empty, delta_type, field = _BLOCKS[kind]
        if kind != open_kind:
            if open_kind is not None:
                await stop_block()
            await start_block(empty)
            open_kind = kind
        await sse.send({"type": "content_block_delta", "index": index,
                        "delta": {"type": delta_type, field: text}}, "content_block_delta")

    async def tail(calls: list[ToolCall]) -> None:
        if open_kind is not None:
            await stop_block()
        elif not calls:  # an empty answer is still one (empty) text block
            await start_block(dict(_BLOCKS["content"][0]))
            await stop_block()
        for call in calls:
            await start_block(_tool_use(call, input_value={}))
            await sse.send({"type": "content_block_delta", "index": index, "delta": {
                "type": "input_json_delta", "partial_json": call.arguments}}, "content_block_delta")
            await stop_block()
        await sse.send({"type": "message_delta",
                        "delta": {"stop_reason": _stop_reason(gen, calls),
                                  "stop_sequence": gen.stop_string},
                        "usage": _usage(gen),
                        "x_engine_stats": gen.engine_stats}, "message_delta")
        await sse.send({"type": "message_stop"}, "message_stop")

    try:
        async with contextlib.aclosing(output_pieces(gen, parser)) as output:
            async for kind, text, _ in output:
                await piece(kind, text)
        await tail(parser.tool_calls)
    except Exception as e:
        return await sse.fail(e, "anthropic")
    return sse.response
