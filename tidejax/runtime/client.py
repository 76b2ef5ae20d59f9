"""`LocalEngineClient`: the server's EngineClient (tidejax/server/client.py) over an Engine in
this process; the one place that reads the engine's and the scheduler's attributes for it.

The scheduler thread owns the device and calls each request's `on_event` from that thread; the
events are handed to the request's asyncio queue with `loop.call_soon_threadsafe`, never polled.
"""

from __future__ import annotations

import asyncio

from tidejax.runtime.scheduler import DoneEvent, ErrorEvent, GenerationRequest
from tidejax.server.client import EngineInfo, EngineStats, Event
from tidejax.text.toolcalls import DEEPSEEK_V3, GLM, HERMES, KIMI_K2, TOOL_FORMATS, ToolFormat

# the tool-call format of each model type's checkpoints, where their chat template does not show it
TOOL_FORMAT_BY_MODEL_TYPE = {
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v32": DEEPSEEK_V3,
    "glm4_moe": GLM,
    "kimi_k2": KIMI_K2,
    "glm_moe_dsa": GLM,
    "qwen2_moe": HERMES,
    "qwen3_moe": HERMES,
}


def tool_format_for(model_type: str, template_source: str) -> ToolFormat | None:
    """The format the chat template teaches (what taught the model), else the model type's
    usual one, else None."""
    for fmt in TOOL_FORMATS:
        if fmt.template_marker in template_source:
            return fmt
    return TOOL_FORMAT_BY_MODEL_TYPE.get(model_type)


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
        return EngineStats(status=self.scheduler.status, queued=self.scheduler.queued,
                           active=self.scheduler.active,
                           residency=self.engine.residency.stats(),
                           kv=self.scheduler.kv_stats())
