"""OpenAI routes: /v1/chat/completions, /v1/completions (streaming by server-sent events or
not). A stream asked for with `stream_options.include_usage` ends with a chunk whose `choices`
is empty and which carries `usage` and the engine's own `x_engine_stats` (prefill and decode
tok/s, cold share, picks computed on the host CPU); every stream ends with `data: [DONE]`."""

from __future__ import annotations

import contextlib
import time

from aiohttp import web

from tidejax.server.generation import Generation, output_pieces
from tidejax.server.sse import SSE
from tidejax.text.toolcalls import OutputParser, ToolCall


def _usage(gen: Generation) -> dict:
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


def _finish_reason(gen: Generation, calls: list[ToolCall]) -> str:
    return "tool_calls" if calls else ("length" if gen.finish_reason == "length" else "stop")


def _tool_calls(calls: list[ToolCall]) -> list[dict]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


async def chat_completion(request: web.Request, gen: Generation, parser: OutputParser,
                          stream: bool, include_usage: bool) -> web.StreamResponse:
    created = int(time.time())
    head = {"id": gen.id, "created": created, "model": gen.model.name}
    if not stream:
        pieces = {"reasoning": [], "content": []}
        async with contextlib.aclosing(output_pieces(gen, parser)) as output:
            async for kind, piece in output:
                pieces[kind].append(piece)
        calls = parser.tool_calls
        message = {"role": "assistant", "content": "".join(pieces["content"]) or None}
        if pieces["reasoning"]:
            message["reasoning_content"] = "".join(pieces["reasoning"])
        if calls:
            message["tool_calls"] = _tool_calls(calls)
        elif message["content"] is None and not pieces["reasoning"]:
            message["content"] = ""
        return web.json_response({
            **head, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _finish_reason(gen, calls)}],
            "usage": _usage(gen), "x_engine_stats": gen.engine_stats})

    sse = SSE(request)
    await sse.start()

    def chunk(delta: dict, finish_reason: str | None = None) -> dict:
        return {**head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                             "logprobs": None}]}

    def delta(kind: str, text: str) -> dict:
        return chunk({"reasoning_content" if kind == "reasoning" else "content": text})

    try:
        await sse.send(chunk({"role": "assistant", "content": ""}))
        async with contextlib.aclosing(output_pieces(gen, parser)) as output:
            async for kind, piece in output:
                await sse.send(delta(kind, piece))
        calls = parser.tool_calls
        if calls:
            await sse.send(chunk({"tool_calls": [
                {"index": i, **call} for i, call in enumerate(_tool_calls(calls))]}))
        await sse.send(chunk({}, _finish_reason(gen, calls)))
        if include_usage:
            await sse.send({**head, "object": "chat.completion.chunk", "choices": [],
                            "usage": _usage(gen), "x_engine_stats": gen.engine_stats})
        await sse.send("[DONE]")
    except Exception as e:
        return await sse.fail(e, "openai")
    return sse.response


async def completion(request: web.Request, gen: Generation, stream: bool,
                     include_usage: bool) -> web.StreamResponse:
    head = {"id": gen.id, "object": "text_completion", "created": int(time.time()),
            "model": gen.model.name}

    def choice(text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def finish() -> str:
        return "length" if gen.finish_reason == "length" else "stop"

    if not stream:
        async with contextlib.aclosing(gen.texts()) as texts:
            text = "".join([t async for t in texts])
        return web.json_response({**head, "choices": [choice(text, finish())],
                                  "usage": _usage(gen), "x_engine_stats": gen.engine_stats})
    sse = SSE(request)
    await sse.start()
    try:
        async with contextlib.aclosing(gen.texts()) as texts:
            async for text in texts:
                await sse.send({**head, "choices": [choice(text, None)]})
        await sse.send({**head, "choices": [choice("", finish())]})
        if include_usage:
            await sse.send({**head, "choices": [], "usage": _usage(gen),
                            "x_engine_stats": gen.engine_stats})
        await sse.send("[DONE]")
    except Exception as e:
        return await sse.fail(e, "openai")
    return sse.response
