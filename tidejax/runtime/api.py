"""The client protocol: all the HTTP layer knows of an engine (the server imports this module
alone from the runtime).

The served model's fixed facts (`EngineInfo`), one way in (`submit` a GenerationRequest, read its
events from a `RequestStream`), plain stats for /health and /metrics (`EngineStats`), and start /
stop. The server never holds an Engine, its scheduler or a jax.Array; runtime/client.py
implements `EngineClient` for an engine in the same process. The requests and events are plain
dataclasses, and a request's sampling is one `SamplingParams` (runtime/sampling.py, re-exported
here with its `SamplingError`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from tidejax.runtime.sampling import SamplingError, SamplingParams
from tidejax.text.chat_template import ChatTemplate
from tidejax.text.harmony import HarmonyFormat
from tidejax.text.tokenizer import Tokenizer
from tidejax.text.toolcalls import ToolFormat

__all__ = ["DoneEvent", "EngineClient", "EngineInfo", "EngineStats", "ErrorEvent", "Event",
           "GenerationRequest", "RequestStream", "SamplingError", "SamplingParams", "TokenEvent"]


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks, parity tests)


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprob: float | None = None  # where the request asked for logprobs: the token's
    top: tuple[tuple[int, float], ...] = ()  # and its request's top (token id, logprob), best first


@dataclasses.dataclass(frozen=True)
class DoneEvent:
    finish_reason: str  # "stop" | "length" | "cancelled"
    stats: dict


@dataclasses.dataclass(frozen=True)
class ErrorEvent:
    message: str


Event = TokenEvent | DoneEvent | ErrorEvent


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """The served model, fixed once it has loaded. The chat template and the tool-call format
    come from the model (its checkpoint and family), so the server needs no per-model branch."""

    name: str  # the model name requests must give
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None  # None: the checkpoint has none (no chat routes)
    tool_format: ToolFormat | HarmonyFormat | None  # how the model writes tool calls (and, for
    # harmony, its whole reply); None: not parsed
    lanes: int  # requests decoded together
    max_context: int  # prompt and generated tokens of one request, together


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot for /health and /metrics, of plain Python values only."""

    status: str = "ready"  # "recovering" while a failed step's state is rebuilt; "failed"
    failure: str = ""  # why the status is "failed"
    queued: int = 0  # requests waiting for a lane
    active: int = 0  # requests in a lane
    residency: dict = dataclasses.field(default_factory=dict)  # name -> number (a few labels)
    kv: dict = dataclasses.field(default_factory=dict)  # KV pool: pages in use, preemptions, ...
    # the prompt cache's counters since start: matched_tokens (not prefilled), evictions (pages),
    # tiers: {device / host / disk: both per tier}, processes: {process index: its host and
    # disk tiers' pages, bytes, hits, evictions} (Scheduler.cache_stats)
    cache: dict = dataclasses.field(default_factory=dict)
    # speculative decoding's drafted_tokens, accepted_tokens and acceptance since start ({}: off)
    speculative: dict = dataclasses.field(default_factory=dict)


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

    def expert_map(self) -> tuple[np.ndarray, np.ndarray]:
        """Now: (demand [L_moe, E] float64 decayed routing weight, resident [L_moe, E] bool), host
        copies (the dashboard's heatmap)."""
