"""OpenAI routes: /v1/chat/completions, /v1/completions (streaming by server-sent events or
not). A request's `n` choices run as requests of their own and stream interleaved, each chunk
naming its choice's index. A stream asked for with `stream_options.include_usage` ends with a
chunk whose `choices` is empty and which carries `usage` (every choice's completion tokens) and
the engine's own `x_engine_stats` (prefill and decode tok/s, cold share, picks computed on the
host CPU, of the first choice);
every stream ends with `data: [DONE]`. Logprobs come in OpenAI's shapes: chat's
`{"content": [{token, logprob, bytes, top_logprobs}]}` and the completions'
`{tokens, token_logprobs, top_logprobs, text_offset}`, with each chunk the tokens whose text it
carries."""

from __future__ import annotations

import contextlib
import time

from aiohttp import web

from tidejax.server.generation import Generation, TokenLogprob, merged, output_pieces
from tidejax.server.sse import SSE
from tidejax.text.tokenizer import Tokenizer
from tidejax.text.toolcalls import OutputParser, ToolCall


def _usage(gens: list[Generation]) -> dict:
    """The prompt counted once, as its first choice saw it (cached tokens included)."""
    completion = sum(gen.completion_tokens for gen in gens)
    return {"prompt_tokens": gens[0].prompt_tokens, "completion_tokens": completion,
            "total_tokens": gens[0].prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": gens[0].cached_tokens}}


def _finish_reason(gen: Generation, calls: list[ToolCall]) -> str:
    return "tool_calls" if calls else ("length" if gen.finish_reason == "length" else "stop")


def _tool_calls(calls: list[ToolCall]) -> list[dict]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def _wants_logprobs(gen: Generation) -> bool:
    return gen.request.sampling.logprobs is not None


def _token(tokenizer: Tokenizer, token: int, logprob: float) -> dict:
    raw = tokenizer.token_bytes(token)
    return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}


def _chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict:
    return {"content": [{**_token(tokenizer, e.token, e.logprob),
                         "top_logprobs": [_token(tokenizer, t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def _completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict:
    """The legacy shape; where alternatives print alike (pieces of a UTF-8 character), the
    likelier one's logprob stands for the text."""
    def text(token: int) -> str:
        return tokenizer.token_bytes(token).decode("utf-8", "replace")

    def top(entry: TokenLogprob) -> dict:
        out = {}
        for token, logprob in entry.top:
            out.setdefault(text(token), logprob)
        return out

    return {"tokens": [text(e.token) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [top(e) for e in entries], "text_offset": [e.offset for e in entries]}


async def _ended(source):
    """The items of `source`, then None: the choice has ended (its finish reason is known)."""
    async with contextlib.aclosing(source) as items:
        async for item in items:
            yield item
    yield None


async def chat_completion(request: web.Request, gens: list[Generation],
                          parsers: list[OutputParser], stream: bool,
                          include_usage: bool) -> web.StreamResponse:
    created = int(time.time())
    first = gens[0]
    head = {"id": first.id, "created": created, "model": first.model.name}
    tokenizer = first.model.info.tokenizer
    choices = merged([_ended(output_pieces(g, p)) for g, p in zip(gens, parsers)])
    if not stream:
        pieces = [{"reasoning": [], "content": [], "logprobs": []} for _ in gens]
        async with contextlib.aclosing(choices) as output:
            async for i, item in output:
                if item is not None:
                    kind, piece, logprobs = item
                    pieces[i][kind].append(piece)
                    pieces[i]["logprobs"] += logprobs

        def choice(i: int, gen: Generation) -> dict:
            calls, got = parsers[i].tool_calls, pieces[i]
            message = {"role": "assistant", "content": "".join(got["content"]) or None}
            if got["reasoning"]:
                message["reasoning_content"] = "".join(got["reasoning"])
            if calls:
                message["tool_calls"] = _tool_calls(calls)
            elif message["content"] is None and not got["reasoning"]:
                message["content"] = ""
            logprobs = (_chat_logprobs(tokenizer, got["logprobs"]) if _wants_logprobs(gen)
                        else None)
            return {"index": i, "message": message, "logprobs": logprobs,
                    "finish_reason": _finish_reason(gen, calls)}

        return web.json_response({
            **head, "object": "chat.completion",
            "choices": [choice(i, gen) for i, gen in enumerate(gens)],
            "usage": _usage(gens), "x_engine_stats": first.engine_stats})

    sse = SSE(request)
    await sse.start()

    def chunk(i: int, delta: dict, finish_reason: str | None = None,
              logprobs: list[TokenLogprob] = ()) -> dict:
        return {**head, "object": "chat.completion.chunk",
                "choices": [{"index": i, "delta": delta, "finish_reason": finish_reason,
                             "logprobs": _chat_logprobs(tokenizer, logprobs) if logprobs
                             else None}]}

    try:
        for i in range(len(gens)):
            await sse.send(chunk(i, {"role": "assistant", "content": ""}))
        async with contextlib.aclosing(choices) as output:
            async for i, item in output:
                if item is not None:
                    kind, piece, logprobs = item
                    field = "reasoning_content" if kind == "reasoning" else "content"
                    await sse.send(chunk(i, {field: piece}, logprobs=logprobs))
                    continue
                calls = parsers[i].tool_calls
                if calls:
                    await sse.send(chunk(i, {"tool_calls": [
                        {"index": j, **call} for j, call in enumerate(_tool_calls(calls))]}))
                await sse.send(chunk(i, {}, _finish_reason(gens[i], calls)))
        if include_usage:
            await sse.send({**head, "object": "chat.completion.chunk", "choices": [],
                            "usage": _usage(gens), "x_engine_stats": first.engine_stats})
        await sse.send("[DONE]")
    except Exception as e:
        return await sse.fail(e, "openai")
    return sse.response


async def completion(request: web.Request, gens: list[Generation], stream: bool,
                     include_usage: bool) -> web.StreamResponse:
    first = gens[0]
    head = {"id": first.id, "object": "text_completion", "created": int(time.time()),
            "model": first.model.name}
    tokenizer = first.model.info.tokenizer
    choices = merged([_ended(gen.texts()) for gen in gens])

    def choice(i: int, text: str, finish_reason: str | None,
               logprobs: list[TokenLogprob] | None) -> dict:
        return {"index": i, "text": text, "finish_reason": finish_reason,
                "logprobs": None if logprobs is None else _completion_logprobs(tokenizer, logprobs)}

    def finish(gen: Generation) -> str:
        return "length" if gen.finish_reason == "length" else "stop"

    if not stream:
        texts, logprobs = [[] for _ in gens], [[] for _ in gens]
        async with contextlib.aclosing(choices) as output:
            async for i, item in output:
                if item is not None:
                    texts[i].append(item[0])
                    logprobs[i] += item[1]
        return web.json_response({**head, "choices": [
            choice(i, "".join(texts[i]), finish(gen), logprobs[i] if _wants_logprobs(gen) else None)
            for i, gen in enumerate(gens)], "usage": _usage(gens),
            "x_engine_stats": first.engine_stats})
    sse = SSE(request)
    await sse.start()
    try:
        async with contextlib.aclosing(choices) as output:
            async for i, item in output:
                if item is None:
                    await sse.send({**head, "choices": [choice(i, "", finish(gens[i]), None)]})
                else:
                    text, logprobs = item
                    await sse.send({**head, "choices": [choice(i, text, None, logprobs or None)]})
        if include_usage:
            await sse.send({**head, "choices": [], "usage": _usage(gens),
                            "x_engine_stats": first.engine_stats})
        await sse.send("[DONE]")
    except Exception as e:
        return await sse.fail(e, "openai")
    return sse.response
