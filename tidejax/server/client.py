"""The HTTP layer's view of the engine: submit a request, read its events from an asyncio queue.

The scheduler thread owns the device and calls `on_event` from that thread; each request's
events are handed to the event loop with `loop.call_soon_threadsafe`, never polled. Handlers
never see a jax.Array, only token ids and plain stats.
"""

from __future__ import annotations

import asyncio

from tidejax.engine.scheduler import DoneEvent, ErrorEvent, GenerationRequest
from tidejax.server.errors import APIError


class RequestStream:
    """One submitted request: `async for event in stream` (TokenEvent... then DoneEvent or
    ErrorEvent). `cancel()` frees its lane before the scheduler's next step."""

    def __init__(self, scheduler, loop: asyncio.AbstractEventLoop, request: GenerationRequest):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        self.handle = scheduler.submit(request, self._on_event)

    def _on_event(self, event) -> None:  # the scheduler thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.done:
            raise StopAsyncIteration
        event = await self.queue.get()
        self.done = isinstance(event, (DoneEvent, ErrorEvent))
        return event

    def cancel(self) -> None:
        self.handle.cancel()


class EngineClient:
    def __init__(self, engine, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.scheduler = engine.scheduler
        self.loop = loop

    def submit(self, request: GenerationRequest) -> RequestStream:
        try:
            return RequestStream(self.scheduler, self.loop, request)
        except ValueError as e:  # the scheduler refuses a request it cannot run
            raise APIError(400, str(e)) from None

    @property
    def queued(self) -> int:
        return self.scheduler.queued

    @property
    def active(self) -> int:
        return self.scheduler.active
