"""The aiohttp application: short route functions over one `Server` (state, auth, metrics), one
middleware that checks the key and maps every exception to the route's error shape. A request's
body is parsed and its prompt rendered and tokenized on worker threads, never on the event loop
(/health answers while a large body is read)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import os
import time
from pathlib import Path

from aiohttp import web

from tidejax.config import EngineConfig
from tidejax.errors import RequestError
from tidejax.server import anthropic_api, openai_api
from tidejax.runtime.api import EngineClient, EngineStats
from tidejax.server.errors import APIError, dialect_of, error_response
from tidejax.server.generation import Generation, ServedModel, new_id
from tidejax.server.metrics import Metrics
from tidejax.server.schemas import (ChatInput, GenerationOptions, parse_chat, parse_completion,
                                    parse_json, parse_messages)

PREPARE_THREADS = 4  # requests parsed and tokenized at once
from tidejax.text.toolcalls import OutputParser

log = logging.getLogger("tidejax.server")


def api_keys(config: EngineConfig) -> tuple[str, ...]:
    """server.api_keys plus the comma-separated keys in the variable named by api_keys_env."""
    keys = list(config.server.api_keys)
    if config.server.api_keys_env:
        keys += [k.strip() for k in os.environ.get(config.server.api_keys_env, "").split(",")]
    return tuple(k for k in keys if k)


class Server:
    """What the routes share. `status` goes "loading" -> "ready" once an engine client is
    attached (started)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.keys = [k.encode() for k in api_keys(config)]
        self.metrics = Metrics()
        self.status = "loading"
        self.name = config.model.served_name or Path(config.model.path).name
        self.started = time.time()
        self.client: EngineClient | None = None
        self.model: ServedModel | None = None
        self.workers = concurrent.futures.ThreadPoolExecutor(PREPARE_THREADS,
                                                             thread_name_prefix="tidejax-prepare")

    async def off_loop(self, fn, *args):
        """fn(*args) on a worker thread (JSON parsing, templates, tokenization)."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)

    def attach(self, client: EngineClient) -> None:
        self.client = client
        self.model = ServedModel.of(client.info, self.config.server.max_tokens_limit)
        self.name = self.model.name
        self.status = "ready"

    def check_key(self, request: web.Request) -> None:
        if not self.keys:
            return
        auth = request.headers.get("Authorization", "")
        given = [auth[7:].strip()] if auth[:7].lower() == "bearer " else []
        given += [request.headers["x-api-key"]] if "x-api-key" in request.headers else []
        if not given:
            raise APIError(401, "missing API key: send 'Authorization: Bearer KEY' or "
                                "'x-api-key: KEY'", code="invalid_api_key")
        ok = False
        for key in self.keys:  # every key compared, in constant time each
            for g in given:  # as sent: aiohttp decodes header bytes with surrogateescape
                ok |= hmac.compare_digest(g.encode("utf-8", "surrogateescape"), key)
        if not ok:
            raise APIError(401, "invalid API key", code="invalid_api_key")

    def ready_model(self, name: str) -> ServedModel:
        if self.status != "ready":
            raise APIError(503, "the model is still loading; GET /health says when it is ready")
        if name != self.model.name:
            raise APIError(404, f"model {name!r} is not served here (this server serves "
                                f"{self.model.name!r})", param="model", code="model_not_found")
        return self.model

    def generations(self, prefix: str, prompt_ids: list[int], options: GenerationOptions,
                    max_new: int) -> list[Generation]:
        """The request's `n` choices, one Generation each under one id."""
        request_id = new_id(prefix)
        return [Generation(self.client, self.metrics, self.model, request_id, prompt_ids, options,
                           max_new, index) for index in range(options.n)]

    def chat_generations(self, chat: ChatInput,
                         prefix: str) -> tuple[list[Generation], list[OutputParser]]:
        """The generations and output parsers of a chat request's choices (on a worker
        thread)."""
        model = self.ready_model(chat.model)
        prompt_ids, in_reasoning = model.chat_prompt(chat)
        options = model.options(chat.options, chat.thinking)
        max_new = model.budget(len(prompt_ids), options)
        tool_format = model.info.tool_format if chat.tools else None
        return (self.generations(prefix, prompt_ids, options, max_new),
                [OutputParser(tool_format, in_reasoning, chat.tools)
                 for _ in range(options.n)])


SERVER = web.AppKey("server", Server)


@web.middleware
async def api_middleware(request: web.Request, handler):
    server = request.app[SERVER]
    try:
        if request.path != "/health":
            server.check_key(request)
        response = await handler(request)
    except Exception as e:
        response = error_response(e, dialect_of(request.path))
        if isinstance(e.__cause__, web.RequestPayloadError):
            response.force_close()  # the body's rest cannot be read: no next request here
        log.info("%s %s -> %d %s", request.method, request.path, response.status,
                 response.text[:300])
    route = request.match_info.route.resource
    server.metrics.record_response(route.canonical if route else "unmatched", response.status)
    return response


async def read_body(request: web.Request) -> bytes:
    """The request's body; a body that does not decode (as its Content-Encoding says) is the
    client's error."""
    try:
        return await request.read()
    except web.RequestPayloadError as e:
        request.content.feed_eof()  # the rest is unreadable: aiohttp should not read on (and log)
        reason = getattr(e.__cause__, "message", None) or str(e)
        raise RequestError(f"the request body cannot be read: {reason}") from e


def _chat(server: Server, raw: bytes, parse, prefix: str):
    chat = parse(parse_json(raw))
    return (chat, *server.chat_generations(chat, prefix))


def _completion(server: Server, raw: bytes):
    body = parse_completion(parse_json(raw))
    model = server.ready_model(body.model)
    prompt_ids = model.completion_prompt(body.prompt)
    options = model.options(body.options, None)
    max_new = model.budget(len(prompt_ids), options)
    return body, server.generations("cmpl-", prompt_ids, options, max_new)


def _count(server: Server, raw: bytes) -> int:
    chat = parse_messages(parse_json(raw), count_only=True)
    return len(server.ready_model(chat.model).chat_prompt(chat)[0])


async def chat_completions(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER]
    chat, gens, parsers = await server.off_loop(_chat, server, await read_body(request),
                                                parse_chat, "chatcmpl-")
    return await openai_api.chat_completion(request, gens, parsers, chat.stream,
                                            chat.include_usage)


async def completions(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER]
    body, gens = await server.off_loop(_completion, server, await read_body(request))
    return await openai_api.completion(request, gens, body.stream, body.include_usage)


async def messages(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER]
    chat, [gen], [parser] = await server.off_loop(_chat, server, await read_body(request),
                                                  parse_messages, "msg_")
    return await anthropic_api.message(request, gen, parser, chat.stream)


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's POST /v1/messages/count_tokens: the prompt's length under the chat template."""
    server = request.app[SERVER]
    return web.json_response({"input_tokens": await server.off_loop(
        _count, server, await read_body(request))})


def _model_object(server: Server, anthropic: bool) -> dict:
    """The served model as OpenAI lists it, or as Anthropic does (a request that sends
    `anthropic-version`, as the anthropic SDK does)."""
    if anthropic:
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(server.started))
        return {"type": "model", "id": server.name, "display_name": server.name,
                "created_at": created}
    return {"id": server.name, "object": "model", "created": int(server.started),
            "owned_by": "tidejax", "status": server.status}


async def models(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    anthropic = "anthropic-version" in request.headers
    data = [_model_object(server, anthropic)]
    if anthropic:
        return web.json_response({"data": data, "has_more": False, "first_id": server.name,
                                  "last_id": server.name})
    return web.json_response({"object": "list", "data": data})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: the served model, else 404 naming the one served."""
    server = request.app[SERVER]
    anthropic = "anthropic-version" in request.headers
    name = request.match_info["id"]
    if name != server.name:
        err = APIError(404, f"model {name!r} is not served here (this server serves "
                            f"{server.name!r})", param="model", code="model_not_found")
        return error_response(err, "anthropic" if anthropic else "openai")
    return web.json_response(_model_object(server, anthropic))


async def health(request: web.Request) -> web.Response:
    """"loading", then the engine's status: "ready", "recovering" (a failed step's state is
    being rebuilt; requests queue) or "failed"; 200 only when ready."""
    server = request.app[SERVER]
    body = {"status": server.status, "model": server.name}
    if server.client is not None:
        stats = server.client.stats()
        body.update(status=stats.status, lanes=server.client.info.lanes, active=stats.active,
                    queued=stats.queued)
    return web.json_response(body, status=200 if body["status"] == "ready" else 503)


async def metrics(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    stats = server.client.stats() if server.client is not None else EngineStats()
    return web.Response(text=server.metrics.render(stats),
                        content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


def build_app(server: Server) -> web.Application:
    app = web.Application(middlewares=[api_middleware],
                          client_max_size=server.config.server.max_body_bytes)
    app[SERVER] = server

    async def stop_workers(_: web.Application) -> None:
        server.workers.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_workers)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{id}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
