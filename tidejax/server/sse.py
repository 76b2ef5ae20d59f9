"""Server-sent events: the streaming transport of both APIs."""

from __future__ import annotations

import json

from aiohttp import web

from tidejax.server.errors import as_api_error, error_body


class SSE:
    """A text/event-stream response; `send(data)` writes one `data:` event."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

    async def start(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, data: dict | str, event: str | None = None) -> None:
        text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        head = f"event: {event}\n" if event else ""
        await self.response.write(f"{head}data: {text}\n\n".encode())

    async def fail(self, exc: Exception, dialect: str) -> web.StreamResponse:
        """After the headers went out, an error can only be an event; when the client is gone
        (the request is cancelled already) there is nobody to tell."""
        if isinstance(exc, ConnectionError):
            return self.response
        body = error_body(as_api_error(exc), dialect)
        await self.send(body, event="error" if dialect == "anthropic" else None)
        return self.response
