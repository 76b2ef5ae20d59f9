"""Lanes, pages and continuous batching: one thread owns the device.

Each iteration frees the lanes of cancelled requests, makes sure the KV pool has a page for every
decoding lane's next position (preempting the newest request when it has not), admits queued
requests into free lanes while the pool has pages for their prompts, queues one step, then reads
the tokens of the step queued in the previous iteration and delivers them.

A step carries every decoding lane's next token and up to `engine.prefill_chunk` prompt tokens of
one admitting request (one request prefills at a time, chunk by chunk), so a long prompt never
stalls the decoding lanes for more than a step; the step after a prompt's last chunk decodes that
request like the others. One step is always in flight: the device runs step N+1 while the host
delivers step N's tokens, and step N+1 takes its input tokens from step N's output on the device
(a lane resumed since takes its token from the host). A stop token is seen one step late: the
step already queued for that lane computes a token nobody receives, at a position its next
request overwrites. Length limits are known ahead, so no step runs past them. Families that need
every token on the host before the next step (`engine.pipelined` False) read each step right
after queueing it.

Preemption: when the pool runs short, the newest admitted request gives up its lane; its pages
and its lane's fixed rows (DeepSeek-V4.1's window rings) are copied to host memory and it waits
at the head of the queue, to resume where it was (same positions, same token, same sampling keys),
in whatever lane is free, once pages are free again.

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

from tidejax.runtime.engine import DecodeRows, PrefillChunk
from tidejax.runtime.sampling import LaneSampling, SamplingParams
from tidejax.kv.pages import PageTable, pages_for

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
        self.started_at = 0.0  # when its prefill began
        self.admitted_at = 0  # admission order: the newest is preempted first
        self.prefilled = 0  # prompt tokens written to the cache
        self.first_token_at = 0.0
        self.saved: _Saved | None = None  # while preempted

    def cancel(self) -> None:
        """Frees the lane before the next step (safe from any thread)."""
        self.cancelled = True


@dataclasses.dataclass
class _Saved:
    """A preempted request's place: what Engine.read_sequence saved (its KV pages, its lane's
    rows and host-input state, in host memory), the position and host token of its next step."""

    pages: object
    n_pages: int
    position: int
    token: int


@dataclasses.dataclass
class _Step:
    """A queued step whose tokens have not been read yet."""

    tokens: object  # jax.Array [lanes]: each lane's next token, on the device
    handles: list  # [lanes] the request each lane's token belongs to; None: no token for it
    positions: np.ndarray  # [lanes] the position of each lane's next token


class Scheduler:
    def __init__(self, engine):
        self.engine = engine
        lanes = engine.lanes
        self.lane_of: list[RequestHandle | None] = [None] * lanes
        self.tokens = np.zeros(lanes, np.int32)  # the last token of each lane read to the host
        self.positions = np.zeros(lanes, np.int32)  # the position of each lane's latest token
        self.pages = PageTable(engine.kv_pages, engine.page_size)
        self._prefilling: RequestHandle | None = None  # the request whose prompt is being written
        self._in_flight: _Step | None = None
        self.queue: collections.deque[RequestHandle] = collections.deque()
        self.wake = threading.Condition()
        self.thread: threading.Thread | None = None
        self.running = False
        self.totals = collections.Counter()  # requests, prompt and generated tokens, steps, preemptions
        self._admissions = itertools.count(1)
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

    def kv_stats(self) -> dict:
        """Pages in use and free, preemptions so far, beside the pool's size."""
        return dict(self.engine.kv_stats(), preemptions=self.totals["preemptions"],
                    pages_in_use=self.pages.in_use, pages_free=self.pages.free)

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
        self._make_room()
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

    # -- pages -----------------------------------------------------------------------------

    def _decoding(self, lane: int) -> bool:
        handle = self.lane_of[lane]
        return handle is not None and handle is not self._prefilling

    def _pages_wanted(self) -> int:
        """Pages the decoding lanes need beyond those they hold, for their next positions."""
        return sum(self.pages.shortfall(self.lane_of[lane].id, int(self.positions[lane]) + 1)
                   for lane in range(self.engine.lanes) if self._decoding(lane))

    def _make_room(self) -> None:
        """Preempts the newest requests until every decoding lane has a page for its next token.
        The step in flight is read first: a preempted request's pages must be final."""
        while self._pages_wanted() > self.pages.free:
            if self._in_flight is not None:
                self._deliver(self._in_flight)
                self._in_flight = None
                continue  # delivering may have finished requests and freed their pages
            newest = max((h for h in self.lane_of if h is not None), key=lambda h: h.admitted_at)
            self._preempt(self.lane_of.index(newest))

    def _preempt(self, lane: int) -> None:
        handle = self.lane_of[lane]
        held = self.pages.pages_of(handle.id)
        handle.saved = _Saved(self.engine.read_sequence(held, lane), len(held),
                              int(self.positions[lane]), int(self.tokens[lane]))
        self._vacate(lane)
        self.totals["preemptions"] += 1
        with self.wake:
            self.queue.appendleft(handle)
        log.info("request %d preempted at position %d (%d pages to host memory)", handle.id,
                 handle.saved.position, handle.saved.n_pages)

    # -- admission -------------------------------------------------------------------------

    def _admit(self) -> None:
        while None in self.lane_of:
            with self.wake:
                if not self.queue:
                    return
                handle = self.queue[0]
                if not self._fits(handle):
                    return
                self.queue.popleft()
            lane = self.lane_of.index(None)
            self.lane_of[lane] = handle
            handle.admitted_at = next(self._admissions)
            self._sampling = None
            if handle.saved is not None:
                self._resume(lane, handle)
                continue
            self.pages.grow(handle.id, self._tokens_held(handle))
            handle.started_at = time.perf_counter()
            self._prefilling = handle
            self.totals["requests"] += 1
            self.totals["prompt_tokens"] += len(handle.request.prompt_ids)

    def _fits(self, handle: RequestHandle) -> bool:
        """Whether the queue's head can take a lane now: one prompt prefills at a time, and the
        pool must hold, beside what the decoding lanes need next, the positions it will write."""
        prefilling = handle.prefilled < len(handle.request.prompt_ids)
        if prefilling and self._prefilling is not None:
            return False
        need = pages_for(self._tokens_held(handle), self.pages.page_size)
        return need + self._pages_wanted() <= self.pages.free

    @staticmethod
    def _tokens_held(handle: RequestHandle) -> int:
        """Positions a request's pages cover once (re)admitted: its whole prompt while it
        prefills, up to its next position once it decodes."""
        if handle.saved is None or handle.prefilled < len(handle.request.prompt_ids):
            return len(handle.request.prompt_ids) + 1
        return handle.saved.position + 1

    def _resume(self, lane: int, handle: RequestHandle) -> None:
        pages = self.pages.grow(handle.id, self._tokens_held(handle))
        saved, handle.saved = handle.saved, None
        self.engine.write_sequence(pages[:saved.n_pages], lane, saved.pages)
        self.positions[lane], self.tokens[lane] = saved.position, saved.token
        if handle.prefilled < len(handle.request.prompt_ids):
            self._prefilling = handle
        log.info("request %d resumed at position %d", handle.id, saved.position)

    def _dispatch(self, previous: _Step | None) -> _Step | None:
        """Queues a step for every decoding lane whose request needs another token beyond those
        already in flight (in `previous`, not read yet), with the next chunk of the prefilling
        prompt; None when there is neither."""
        handles = [h if self._decoding(lane) else None for lane, h in enumerate(self.lane_of)]
        if previous is not None:
            for lane, handle in enumerate(handles):
                if (handle is not None and previous.handles[lane] is handle
                        and self._ends_by_length(handle, handle.generated + 1,
                                                 previous.positions[lane])):
                    handles[lane] = None  # the token in flight is its last
        active = np.array([h is not None for h in handles])
        chunk = self._next_chunk()
        if not active.any() and chunk is None:
            return None
        if self._sampling is None:
            self._sampling = LaneSampling.of(
                [h.request.sampling if h else SamplingParams() for h in self.lane_of])
        # a lane continues from its token in flight; one admitted or resumed since takes its
        # host token. Every step carries all lanes (none active while a lone prompt prefills):
        # one compiled step a chunk size, not two.
        fresh = np.array([previous is None or previous.handles[lane] is not handle
                          for lane, handle in enumerate(handles)])
        pages = [self.pages.grow(h.id, int(self.positions[lane]) + 1) if h else []
                 for lane, h in enumerate(handles)]
        decode = DecodeRows(self.tokens, fresh, np.where(active, self.positions, 0), active, pages)
        tokens = self.engine.step(decode, chunk, self._sampling,
                                  previous=previous.tokens if previous else None)
        tokens.copy_to_host_async()  # on its way as soon as the step ends
        self.positions[active] += 1
        self.totals["steps"] += 1
        produced = np.where(active, self.positions, 0)
        if chunk is not None and self._prefilling.prefilled == len(self._prefilling.request.prompt_ids):
            handles[chunk.lane] = self._prefilling  # its first token comes with this step
            self.positions[chunk.lane] = produced[chunk.lane] = chunk.start + len(chunk.tokens)
            self._prefilling = None
        return _Step(tokens, handles, produced)

    def _next_chunk(self) -> PrefillChunk | None:
        """The next prompt chunk of the prefilling request (marked written), or None."""
        handle = self._prefilling
        if handle is None:
            return None
        start = handle.prefilled
        ids = handle.request.prompt_ids[start:start + self.engine.prefill_chunk]
        handle.prefilled += len(ids)
        return PrefillChunk(self.lane_of.index(handle), ids, start, self.pages.pages_of(handle.id))

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
        if not handle.first_token_at:
            handle.first_token_at = time.perf_counter()
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
        self._vacate(lane)
        self.last_stats = self._stats(handle)
        handle.on_event(DoneEvent(reason, self.last_stats))

    def _stats(self, handle: RequestHandle) -> dict:
        prompt = len(handle.request.prompt_ids)
        decode_s = time.perf_counter() - handle.first_token_at if handle.first_token_at else 0.0
        decoded = max(handle.generated - 1, 0)  # the first token came from the prefill
        prefill_s = handle.first_token_at - handle.started_at if handle.first_token_at else 0.0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": handle.generated,
            "ttft_s": handle.first_token_at - handle.submitted if handle.first_token_at else 0.0,
            "prefill_tps": prompt / prefill_s if prefill_s > 0 else 0.0,
            "decode_tps": decoded / decode_s if decode_s and decoded else 0.0,
            "cold_share": self.engine.residency.window_cold_share(),
        }

    def _vacate(self, lane: int) -> None:
        """Frees a lane and its request's pages."""
        handle, self.lane_of[lane] = self.lane_of[lane], None
        if handle is self._prefilling:
            self._prefilling = None
        self.pages.release(handle.id)
        self._sampling = None

    def _fail_all(self, message: str) -> None:
        for lane, handle in enumerate(self.lane_of):
            if handle is not None:
                self._vacate(lane)
                handle.on_event(ErrorEvent(message))
        self._in_flight = None
