"""The `EngineClient` protocol: all the HTTP layer knows of an engine.

The served model's fixed facts (`info`), one way in (`submit` a GenerationRequest, read its
events from a `RequestStream`), plain stats for /health and /metrics, and start / stop. The
server never holds an Engine, its scheduler or a jax.Array; runtime/client.py implements this for
an engine in the same process. The request and event types are the engine's own plain
dataclasses, re-exported here so that the server imports them from its side of the boundary.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from tidejax.text.chat_template import ChatTemplate
from tidejax.runtime.scheduler import DoneEvent, ErrorEvent, GenerationRequest, TokenEvent
from tidejax.text.tokenizer import Tokenizer
from tidejax.text.toolcalls import ToolFormat

Event = TokenEvent | DoneEvent | ErrorEvent

__all__ = ["DoneEvent", "EngineClient", "EngineInfo", "EngineStats", "ErrorEvent", "Event",
           "GenerationRequest", "RequestStream", "TokenEvent"]


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """The served model, fixed once it has loaded. The chat template and the tool-call format
    come from the model (its checkpoint and family), so the server needs no per-model branch."""

    name: str  # the model name requests must give
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None  # None: the checkpoint has none (no chat routes)
    tool_format: ToolFormat | None  # how the model writes tool calls; None: not parsed
    lanes: int  # requests decoded together
    max_context: int  # prompt and generated tokens of one request, together


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot for /health and /metrics, of plain Python values only."""

    status: str = "ready"  # "recovering" while a failed step's state is rebuilt; "failed"
    queued: int = 0  # requests waiting for a lane
    active: int = 0  # requests in a lane
    residency: dict = dataclasses.field(default_factory=dict)  # name -> number (a few labels)
    kv: dict = dataclasses.field(default_factory=dict)  # KV pool: pages in use, preemptions, ...


class RequestStream(Protocol):
    """One submitted request's events, `async for event in stream`: TokenEvent... then one
    DoneEvent or ErrorEvent, where the iteration ends."""

    def __aiter__(self) -> RequestStream: ...

    async def __anext__(self) -> Event: ...

    def cancel(self) -> None:
        """Ends the request early (its lane is freed before the next step); a no-op once the
        stream has ended."""


class EngineClient(Protocol):
    info: EngineInfo

    async def start(self) -> None:
        """Compiles the warm-up shapes, then serves: `submit` works from here on."""

    def stop(self) -> None:
        """Stops serving and releases the engine (finishing its profiler trace, if one runs)."""

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queues `request`; raises ValueError, saying why, when the engine cannot run it. Call
        it on the event loop that reads the stream."""

    def stats(self) -> EngineStats:
        """Now: the queue, the lanes in use and the expert residency's counters."""
