"""Lanes and continuous batching: one thread owns the device.

Each iteration frees the lanes of cancelled requests, admits queued requests into free lanes
(prefill, first token), queues one decode step for every lane that needs another token, then
reads the tokens of the step queued in the previous iteration and delivers them. So one step is
always in flight: the device runs step N+1 while the host delivers step N's tokens, and step N+1
takes its input tokens from step N's output on the device (a lane admitted since takes its
prefill's token from the host). A stop token is seen one step late: the step already queued for
that lane computes a token nobody receives, at a position its next request overwrites. Length
limits are known ahead, so no step runs past them. Families that need every token on the host
before the next step (`engine.pipelined` False) read each step right after queueing it.

A request joins and leaves between steps; the others never wait for it beyond its prefill.
Events go to each request's `on_event` callback from the scheduler thread (the server turns them
into asyncio queue items with loop.call_soon_threadsafe).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import secrets
import threading
import time

import numpy as np

from tidejax.engine.sampling import LaneSampling, SamplingParams

log = logging.getLogger("tidejax")


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


@dataclasses.dataclass(frozen=True)
class DoneEvent:
    finish_reason: str  # "stop" | "length" | "cancelled"
    stats: dict


@dataclasses.dataclass(frozen=True)
class ErrorEvent:
    message: str


class RequestHandle:
    _ids = itertools.count(1)

    def __init__(self, request: GenerationRequest, on_event):
        self.id = next(self._ids)
        self.request = request
        self.on_event = on_event
        self.cancelled = False
        self.generated = 0
        self.submitted = time.perf_counter()
        self.prefill_s = 0.0
        self.first_token_at = 0.0

    def cancel(self) -> None:
        """Frees the lane before the next step (safe from any thread)."""
        self.cancelled = True


@dataclasses.dataclass
class _Step:
    """A queued decode step whose tokens have not been read yet."""

    tokens: object  # jax.Array [lanes]: each lane's next token, on the device
    handles: list  # [lanes] the request each lane decoded for; None: the lane sat out
    positions: np.ndarray  # [lanes] the position of each lane's next token


class Scheduler:
    def __init__(self, engine):
        self.engine = engine
        lanes = engine.lanes
        self.lane_of: list[RequestHandle | None] = [None] * lanes
        self.tokens = np.zeros(lanes, np.int32)  # the last token of each lane read to the host
        self.positions = np.zeros(lanes, np.int32)  # the position of each lane's latest token
        self._in_flight: _Step | None = None
        self.queue: collections.deque[RequestHandle] = collections.deque()
        self.wake = threading.Condition()
        self.thread: threading.Thread | None = None
        self.running = False
        self.totals = collections.Counter()  # requests, prompt and generated tokens, steps
        self._sampling = None
        self.last_stats: dict = {}  # the stats of the request that finished last

    # -- API -------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, on_event) -> RequestHandle:
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.engine.max_context:
            raise ValueError(f"the prompt has {n} tokens; this model's context is "
                             f"{self.engine.max_context} tokens")
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if request.sampling.seed is None:  # unseeded requests must not share one random stream
            request = dataclasses.replace(request, sampling=dataclasses.replace(
                request.sampling, seed=secrets.randbits(31)))
        handle = RequestHandle(request, on_event)
        with self.wake:
            self.queue.append(handle)
            self.wake.notify()
        return handle

    @property
    def queued(self) -> int:
        return len(self.queue)

    @property
    def active(self) -> int:
        return sum(h is not None for h in self.lane_of)

    def start(self) -> None:
        """Runs the loop on a daemon thread (the server); without it, `run_until_idle` drives."""
        self.running = True
        self.thread = threading.Thread(target=self._loop, name="tidejax-scheduler", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.running = False
        with self.wake:
            self.wake.notify()
        if self.thread:
            self.thread.join()

    def run_until_idle(self) -> None:
        while self.step():
            pass

    # -- the loop --------------------------------------------------------------------------

    def _loop(self) -> None:
        while self.running:
            with self.wake:
                while self.running and not self.queue and not self.active and self._in_flight is None:
                    self.wake.wait()
            if self.running:
                try:
                    self.step()
                except Exception as e:  # a failed step must not kill the server
                    log.exception("step failed")
                    self._fail_all(f"engine error: {e}")

    def step(self) -> bool:
        """One iteration; returns whether any work remains."""
        self._release_cancelled()
        self._admit()
        previous, self._in_flight = self._in_flight, self._dispatch(self._in_flight)
        if previous is not None:
            self._deliver(previous)  # waits for it; the step just queued keeps the device busy
        if self._in_flight is not None and not self.engine.pipelined:
            self._deliver(self._in_flight)
            self._in_flight = None
        return bool(self.active or self.queue or self._in_flight)

    def _release_cancelled(self) -> None:
        for lane, handle in enumerate(self.lane_of):
            if handle is not None and handle.cancelled:
                self._finish(lane, "cancelled")
        with self.wake:
            for handle in [h for h in self.queue if h.cancelled]:
                self.queue.remove(handle)
                handle.on_event(DoneEvent("cancelled", self._stats(handle)))

    def _admit(self) -> None:
        while None in self.lane_of:
            with self.wake:
                if not self.queue:
                    return
                handle = self.queue.popleft()
            lane = self.lane_of.index(None)
            start = time.perf_counter()
            try:
                token = self.engine.prefill(lane, handle.request.prompt_ids, handle.request.sampling)
            except Exception as e:  # this request fails; the lanes and the queue go on
                log.exception("prefill failed")
                handle.on_event(ErrorEvent(f"prefill failed: {e}"))
                continue
            handle.prefill_s = time.perf_counter() - start
            handle.first_token_at = time.perf_counter()
            self.lane_of[lane] = handle
            self._sampling = None
            self.positions[lane] = len(handle.request.prompt_ids)
            self.totals["requests"] += 1
            self.totals["prompt_tokens"] += len(handle.request.prompt_ids)
            self._emit(lane, token, self.positions[lane])

    def _dispatch(self, previous: _Step | None) -> _Step | None:
        """Queues a decode step for every lane whose request needs another token beyond those
        already in flight (in `previous`, not read yet); None when no lane does."""
        handles = list(self.lane_of)
        if previous is not None:
            for lane, handle in enumerate(handles):
                if (handle is not None and previous.handles[lane] is handle
                        and self._ends_by_length(handle, handle.generated + 1,
                                                 previous.positions[lane])):
                    handles[lane] = None  # the token in flight is its last
        active = np.array([h is not None for h in handles])
        if not active.any():
            return None
        if self._sampling is None:
            self._sampling = LaneSampling.of(
                [h.request.sampling if h else SamplingParams() for h in self.lane_of])
        # a lane continues from its token in flight; one admitted since takes its host token
        fresh = np.array([previous is None or previous.handles[lane] is not handle
                          for lane, handle in enumerate(handles)])
        tokens = self.engine.decode(self.tokens, np.where(active, self.positions, 0), active,
                                    self._sampling, previous=previous.tokens if previous else None,
                                    fresh=fresh)
        tokens.copy_to_host_async()  # on its way as soon as the step ends
        self.positions[active] += 1
        self.totals["steps"] += 1
        return _Step(tokens, handles, np.where(active, self.positions, 0))

    def _deliver(self, step: _Step) -> None:
        """Reads a step's tokens (waiting for the device) and emits them to the requests still in
        their lanes: not to one finished, cancelled or replaced since the step was queued."""
        tokens = np.asarray(step.tokens)
        for lane, handle in enumerate(step.handles):
            if handle is not None and self.lane_of[lane] is handle:
                self._emit(lane, int(tokens[lane]), step.positions[lane])

    def _emit(self, lane: int, token: int, position: int) -> None:
        """Delivers `token` (at `position`) for the request in `lane`, or ends it."""
        handle = self.lane_of[lane]
        request = handle.request
        if (token in request.stop_token_ids
                or (token in self.engine.eos_ids and not request.ignore_eos)):
            self._finish(lane, "stop")
            return
        handle.generated += 1
        self.totals["generated_tokens"] += 1
        handle.on_event(TokenEvent(token))
        self.tokens[lane] = token
        if self._ends_by_length(handle, handle.generated, position):
            self._finish(lane, "length")

    def _ends_by_length(self, handle: RequestHandle, generated: int, position: int) -> bool:
        """Whether a request is done once it has `generated` tokens, the last at `position`."""
        return (generated >= handle.request.max_new_tokens
                or position + 1 >= self.engine.max_context)

    def _finish(self, lane: int, reason: str) -> None:
        handle = self.lane_of[lane]
        self.lane_of[lane] = None
        self._sampling = None
        self.last_stats = self._stats(handle)
        handle.on_event(DoneEvent(reason, self.last_stats))

    def _stats(self, handle: RequestHandle) -> dict:
        prompt = len(handle.request.prompt_ids)
        decode_s = time.perf_counter() - handle.first_token_at if handle.first_token_at else 0.0
        decoded = max(handle.generated - 1, 0)  # the first token came from the prefill
        return {
            "prompt_tokens": prompt,
            "completion_tokens": handle.generated,
            "prefill_tps": prompt / handle.prefill_s if handle.prefill_s else 0.0,
            "decode_tps": decoded / decode_s if decode_s and decoded else 0.0,
            "cold_share": self.engine.residency.window_cold_share(),
        }

    def _fail_all(self, message: str) -> None:
        for lane, handle in enumerate(self.lane_of):
            if handle is not None:
                self.lane_of[lane] = None
                handle.on_event(ErrorEvent(message))
        self._sampling = None
        self._in_flight = None
