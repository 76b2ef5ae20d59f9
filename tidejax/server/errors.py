"""One error type for the HTTP layer and one function that writes it in each API's shape.

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}

A RequestError (tidejax.errors) is the only 400 of the server's own: anything else raised while
answering (an EngineError, a bug) is a 500 that does not repeat its text, logged once with its
traceback.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web

from tidejax.errors import EngineError, RequestError

log = logging.getLogger("tidejax.server")

_OPENAI_TYPES = {401: "authentication_error", 404: "invalid_request_error",
                 429: "rate_limit_error", 503: "server_error", 500: "server_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 504: "timeout_error"}


ENGINE_FAILED = "the engine failed on this request (the server's log has the details)"
INTERNAL = "internal error (the server's log has the details)"


class APIError(Exception):
    """A request the server answers with `status` (401, 404, 408, 429, 503, 504: not 400, which
    is a RequestError's), `message` and any `headers` (a 429's Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def as_api_error(exc: BaseException) -> APIError:
    """Any exception raised while answering a request, as the error the client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return APIError(400, exc.message, exc.field, exc.code)
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return APIError(413, f"request body too large: {exc.text}", code="request_too_large")
    if isinstance(exc, ConnectionError):  # nobody will read this; 499 as nginx counts it
        return APIError(499, "the client closed the connection")
    if isinstance(exc, web.HTTPException):
        return APIError(exc.status, exc.reason or str(exc))
    engine = isinstance(exc, EngineError)
    log.error("engine error" if engine else "internal error", exc_info=exc)
    return APIError(500, ENGINE_FAILED if engine else INTERNAL)


def error_body(err: APIError, dialect: str) -> dict:
    if dialect == "anthropic":
        kind = _ANTHROPIC_TYPES.get(err.status, "invalid_request_error" if err.status < 500
                                    else "api_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}
    kind = _OPENAI_TYPES.get(err.status, "invalid_request_error" if err.status < 500
                             else "server_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param,
                      "code": err.code}}


def error_response(exc: BaseException, dialect: str) -> web.Response:
    err = as_api_error(exc)
    return web.json_response(error_body(err, dialect), status=err.status, headers=err.headers,
                             dumps=lambda v: json.dumps(v, ensure_ascii=False))


def dialect_of(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"
