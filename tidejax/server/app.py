"""The aiohttp application: short route functions over one `Server` (state, auth, admission,
metrics), one middleware that checks the key and maps every exception to the route's error
shape. A request's body is parsed and its prompt rendered and tokenized on worker threads, never
on the event loop (/health answers while a large body is read). A generating request holds its
places in the server from arrival to its response (server/admission.py: a 429 past the bounds);
its body must arrive within server.body_timeout_s (else a 408 and the connection closed) and its
tokens before server.request_timeout_s from its arrival (else the engine request is cancelled,
freeing its lane and pages, and a 504)."""

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
from tidejax.errors import ConfigError, RequestError
from tidejax.server import anthropic_api, dashboard, openai_api
from tidejax.runtime.api import EngineClient, EngineStats
from tidejax.server.admission import Admission
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


def keys_named(config: EngineConfig) -> str:
    """Where API keys come from, as the settings name them."""
    env = config.server.api_keys_env
    return "server.api_keys" + (f" or ${env}" if env else "")


class Server:
    """What the routes share. `status` goes "loading" -> "ready" once an engine client is
    attached (started)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.keys = [k.encode() for k in api_keys(config)]
        if config.server.max_requests_per_key and not self.keys:
            raise ConfigError(
                f"{config.source_of('server.max_requests_per_key')}: "
                f"'server.max_requests_per_key' = {config.server.max_requests_per_key} limits "
                f"each API key, and no key is set ({keys_named(config)})")
        self.metrics = Metrics()
        self.admission = Admission(config.server, self.metrics)
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
        self.admission.lanes = client.info.lanes
        self.name = self.model.name
        self.status = "ready"

    def check_key(self, request: web.Request) -> int | None:
        """The number of the API key the request sends (None: keys are off), else a 401."""
        if not self.keys:
            return None
        auth = request.headers.get("Authorization", "")
        given = [auth[7:].strip()] if auth[:7].lower() == "bearer " else []
        given += [request.headers["x-api-key"]] if "x-api-key" in request.headers else []
        if dashboard.is_dashboard(request.path):  # a browser's ways (server/dashboard.py)
            given += [v for v in (request.cookies.get(dashboard.COOKIE),
                                  request.query.get("key")) if v]
        if not given:
            raise APIError(401, "missing API key: send 'Authorization: Bearer KEY' or "
                                "'x-api-key: KEY'" + (" (a browser: open /dashboard?key=KEY)"
                                                      if dashboard.is_dashboard(request.path)
                                                      else ""), code="invalid_api_key")
        found = None
        for i, key in enumerate(self.keys):  # every key compared, in constant time each
            for g in given:  # as sent: aiohttp decodes header bytes with surrogateescape
                if hmac.compare_digest(g.encode("utf-8", "surrogateescape"), key):
                    found = i
        if found is None:
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return found

    def ready_model(self, name: str) -> ServedModel:
        if self.status != "ready":
            raise APIError(503, "the model is still loading; GET /health says when it is ready")
        if name != self.model.name:
            raise APIError(404, f"model {name!r} is not served here (this server serves "
                                f"{self.model.name!r})", param="model", code="model_not_found")
        return self.model

    def generations(self, prefix: str, prompt_ids: list[int], options: GenerationOptions,
                    max_new: int, arrived: float) -> list[Generation]:
        """The request's `n` choices, one Generation each under one id, due
        server.request_timeout_s after `arrived` (the event loop's time)."""
        request_id = new_id(prefix)
        timeout = self.config.server.request_timeout_s
        deadline = arrived + timeout if timeout else None
        return [Generation(self.client, self.metrics, self.model, request_id, prompt_ids, options,
                           max_new, index, deadline) for index in range(options.n)]

    def chat_generations(self, chat: ChatInput, prefix: str,
                         arrived: float) -> tuple[list[Generation], list[OutputParser]]:
        """The generations and output parsers of a chat request's choices (on a worker
        thread)."""
        model = self.ready_model(chat.model)
        prompt_ids, in_reasoning = model.chat_prompt(chat)
        options = model.options(chat.options, chat.thinking)
        max_new = model.budget(len(prompt_ids), options)
        fmt = model.info.tool_format
        return (self.generations(prefix, prompt_ids, options, max_new, arrived),
                [fmt.parser(in_reasoning, chat.tools) if fmt is not None
                 else OutputParser(None, in_reasoning, chat.tools) for _ in range(options.n)])


SERVER = web.AppKey("server", Server)
API_KEY = web.RequestKey("api_key", object)  # the request's key number (Server.check_key)


@web.middleware
async def api_middleware(request: web.Request, handler):
    server = request.app[SERVER]
    try:
        request[API_KEY] = None if request.path == "/health" else server.check_key(request)
        response = await handler(request)
    except Exception as e:
        response = error_response(e, dialect_of(request.path))
        if isinstance(e.__cause__, web.RequestPayloadError) or response.status == 408:
            response.force_close()  # the body's rest cannot be read: no next request here
        log.info("%s %s -> %d %s", request.method, request.path, response.status,
                 response.text[:300])
    route = request.match_info.route.resource
    server.metrics.record_response(route.canonical if route else "unmatched", response.status)
    return response


async def read_body(request: web.Request) -> bytes:
    """The request's body; a body that does not decode (as its Content-Encoding says) is the
    client's error, one that has not all arrived within server.body_timeout_s a 408."""
    server = request.app[SERVER]
    timeout = server.config.server.body_timeout_s
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except web.RequestPayloadError as e:
        request.content.feed_eof()  # the rest is unreadable: aiohttp should not read on (and log)
        reason = getattr(e.__cause__, "message", None) or str(e)
        raise RequestError(f"the request body cannot be read: {reason}") from e
    except TimeoutError:
        request.content.feed_eof()  # nor wait for the rest
        server.metrics.body_timeouts += 1
        raise APIError(408, f"the request body did not arrive within server.body_timeout_s = "
                            f"{timeout:g} s", code="body_timeout") from None


def _chat(server: Server, raw: bytes, parse, prefix: str, arrived: float):
    chat = parse(parse_json(raw))
    return (chat, *server.chat_generations(chat, prefix, arrived))


def _completion(server: Server, raw: bytes, arrived: float):
    body = parse_completion(parse_json(raw))
    model = server.ready_model(body.model)
    prompt_ids = model.completion_prompt(body.prompt)
    options = model.options(body.options, None)
    max_new = model.budget(len(prompt_ids), options)
    return body, server.generations("cmpl-", prompt_ids, options, max_new, arrived)


def _count(server: Server, raw: bytes) -> int:
    chat = parse_messages(parse_json(raw), count_only=True)
    return len(server.ready_model(chat.model).chat_prompt(chat)[0])


async def chat_completions(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER]
    with server.admission.ticket(request[API_KEY]) as ticket:
        chat, gens, parsers = await server.off_loop(_chat, server, await read_body(request),
                                                    parse_chat, "chatcmpl-", ticket.arrived)
        ticket.need(len(gens))
        return await openai_api.chat_completion(request, gens, parsers, chat.stream,
                                                chat.include_usage)


async def completions(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER]
    with server.admission.ticket(request[API_KEY]) as ticket:
        body, gens = await server.off_loop(_completion, server, await read_body(request),
                                           ticket.arrived)
        ticket.need(len(gens))
        return await openai_api.completion(request, gens, body.stream, body.include_usage)


async def messages(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER]
    with server.admission.ticket(request[API_KEY]) as ticket:
        chat, [gen], [parser] = await server.off_loop(_chat, server, await read_body(request),
                                                      parse_messages, "msg_", ticket.arrived)
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
    being rebuilt; requests queue) or "failed" (with the reason); 200 only when ready."""
    server = request.app[SERVER]
    body = {"status": server.status, "model": server.name}
    if server.client is not None:
        stats = server.client.stats()
        body.update(status=stats.status, lanes=server.client.info.lanes, active=stats.active,
                    queued=stats.queued)
        if stats.failure:
            body["reason"] = stats.failure
    return web.json_response(body, status=200 if body["status"] == "ready" else 503)


async def metrics(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    stats = server.client.stats() if server.client is not None else EngineStats()
    return web.Response(text=server.metrics.render(stats, server.admission.held),
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
    if server.config.server.dashboard:
        dashboard.add_routes(app, server)
    return app
