"""`LocalEngineClient`: the server's EngineClient (tidejax/runtime/api.py) over an Engine in
this process; the one place that reads the engine's and the scheduler's attributes for it.

The scheduler thread owns the device and calls each request's `on_event` from that thread; the
events are handed to the request's asyncio queue with `loop.call_soon_threadsafe`, never polled.
"""

from __future__ import annotations

import asyncio

import numpy as np

from tidejax.models.registry import family_of
from tidejax.runtime.api import (DoneEvent, EngineInfo, EngineStats, ErrorEvent, Event,
                                 GenerationRequest)
from tidejax.text.harmony import HARMONY
from tidejax.text.toolcalls import TOOL_FORMATS


def tool_format_for(model_type: str, template_source: str):
    """The format the chat template teaches (what taught the model), else the one the model
    type's family names (Family.tool_formats), else None: a text.toolcalls.ToolFormat or
    gpt-oss's text.harmony.HARMONY."""
    for fmt in (HARMONY, *TOOL_FORMATS):
        if fmt.template_marker in template_source:
            return fmt
    family = family_of(model_type)
    return family.tool_formats.get(model_type) if family is not None else None


class LocalRequestStream:
    """A RequestStream over one scheduler request; made on the event loop that reads it."""

    def __init__(self, scheduler, request: GenerationRequest):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.done = False
        self.handle = scheduler.submit(request, self._on_event)

    def _on_event(self, event: Event) -> None:  # the scheduler thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        if self.done:
            raise StopAsyncIteration
        event = await self.queue.get()
        self.done = isinstance(event, (DoneEvent, ErrorEvent))
        return event

    def cancel(self) -> None:
        if not self.done:
            self.handle.cancel()


class LocalEngineClient:
    def __init__(self, engine):
        self.engine = engine
        self.scheduler = engine.scheduler
        template = engine.tokenizer.chat_template
        self.info = EngineInfo(
            name=engine.served_name, tokenizer=engine.tokenizer, chat_template=template,
            tool_format=tool_format_for(engine.cfg.model_type, template.source if template else ""),
            lanes=engine.lanes, max_context=engine.max_context)

    async def start(self) -> None:
        if self.engine.config.engine.warmup:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.warmup)
        self.scheduler.start()

    def stop(self) -> None:
        if self.scheduler.thread is not None:
            self.scheduler.stop()
        self.engine.close()

    def submit(self, request: GenerationRequest) -> LocalRequestStream:
        return LocalRequestStream(self.scheduler, request)

    def stats(self) -> EngineStats:
        return EngineStats(status=self.scheduler.status, failure=self.scheduler.failure,
                           queued=self.scheduler.queued, active=self.scheduler.active,
                           residency=self.engine.residency.stats(),
                           kv=self.scheduler.kv_stats(), cache=self.scheduler.cache_stats(),
                           speculative=self.scheduler.speculative_stats())

    def expert_map(self) -> tuple[np.ndarray, np.ndarray]:
        return self.engine.residency.expert_map()
