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
request overwrites. Length limits are known ahead, so no step runs past them.

Preemption: when the pool runs short, the newest admitted request gives up its lane; its pages
and its lane's fixed rows (DeepSeek-V4.1's window rings and Engram look-back) are copied to host
memory and it waits at the head of the queue, to resume where it was (same positions, same
token, same sampling keys), in whatever lane is free, once pages are free again.

Events go to each request's `on_event` callback from the scheduler thread (the server turns them
into asyncio queue items with loop.call_soon_threadsafe).

The scheduler owns the model's one DecodeState (runtime/state.py) and is the only caller of the
jitted steps over it (runtime/steps.py): the mixed step, scoring, sequence reads and writes, the
lanes' sampling updates, and residency's between-step swaps. While its thread runs, any of them
asked for from another thread (`Engine.logits`) goes through `call`, which runs it on the
scheduler thread between two iterations; called from elsewhere they raise.

A step that fails (before its buffers were donated or after) fails the requests in the lanes
with one generic error; `recover` rebuilds the DecodeState (a fresh cache and greedy lanes, the
expert state from the rows no step donates and residency's host map) while `status` says
"recovering", and the queue, preempted requests included, is served on.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import secrets
import threading
import time

import jax
import numpy as np

from tidejax import parallel
from tidejax.kv.pages import PageTable, pages_for
from tidejax.runtime.build import LoadedModel
from tidejax.runtime.replica import Replicas
from tidejax.runtime.sampling import LaneParams, Sampled, SamplingParams
from tidejax.runtime.steps import DecodeRows, PrefillChunk, SavedSequence

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
    logprob: float | None = None  # where the request asked for logprobs: the token's
    top: tuple[tuple[int, float], ...] = ()  # and its request's top (token id, logprob), best first


@dataclasses.dataclass(frozen=True)
class DoneEvent:
    finish_reason: str  # "stop" | "length" | "cancelled"
    stats: dict


@dataclasses.dataclass(frozen=True)
class ErrorEvent:
    message: str


STEP_FAILED = "the engine's step failed (its log has the details)"


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
        self.cpu_picks_at_start = 0  # the engine's host-computed picks when its prefill began
        self.approx_at_start = (0.0, 0.0)  # and its residency.approx_tally()
        self.saved: _Saved | None = None  # while preempted

    def cancel(self) -> None:
        """Frees the lane before the next step (safe from any thread)."""
        self.cancelled = True


@dataclasses.dataclass
class _Saved:
    """A preempted request's place: what Scheduler.read_sequence saved (its KV pages, its lane's
    rows and token counts, in host memory), the position and host token of its next step."""

    pages: SavedSequence
    n_pages: int
    position: int
    token: int


@dataclasses.dataclass
class _Step:
    """A queued step whose tokens have not been read yet."""

    sampled: Sampled  # each lane's next token [lanes] and its logprobs, on the device
    handles: list  # [lanes] the request each lane's token belongs to; None: no token for it
    positions: np.ndarray  # [lanes] the position of each lane's next token


def _share_since(now: tuple[float, float], start: tuple[float, float]) -> float:
    """(part, whole) tallies now and at a start -> part / whole over what came between."""
    whole = now[1] - start[1]
    return (now[0] - start[0]) / whole if whole > 0 else 0.0


class Scheduler:
    def __init__(self, model: LoadedModel, channel=None):
        """channel: process 0's tidejax.distributed channel to its peers, which replay every
        call over the state (tidejax.runtime.replica); None in one process."""
        self.model = model
        self.state = model.initial_state()  # the one DecodeState, donated into every step
        self.replicas = Replicas(channel, model) if channel is not None else None
        lanes = model.lanes
        self.lane_of: list[RequestHandle | None] = [None] * lanes
        self.tokens = np.zeros(lanes, np.int32)  # the last token of each lane read to the host
        self.positions = np.zeros(lanes, np.int32)  # the position of each lane's latest token
        self.pages = PageTable(model.kv_pages, model.page_size)
        self._prefilling: RequestHandle | None = None  # the request whose prompt is being written
        self._in_flight: _Step | None = None
        self.queue: collections.deque[RequestHandle] = collections.deque()
        self.wake = threading.Condition()
        self.thread: threading.Thread | None = None
        self.running = False
        self.totals = collections.Counter()  # requests, prompt and generated tokens, steps, preemptions
        self._admissions = itertools.count(1)
        self._calls: collections.deque = collections.deque()  # (fn, Future) for the thread
        self.last_stats: dict = {}  # the stats of the request that finished last
        self.status = "ready"  # "recovering" while `recover` rebuilds the state; "failed" after

    # -- API -------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, on_event) -> RequestHandle:
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.model.max_context:
            raise ValueError(f"the prompt has {n} tokens; this model's context is "
                             f"{self.model.max_context} tokens")
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        request.sampling.check_vocab(self.model.vocab_size)
        if self.status == "failed":
            raise RuntimeError("the engine failed and could not rebuild its state")
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
        return dict(self.model.kv_stats(), preemptions=self.totals["preemptions"],
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
            self.thread = None
        while self._calls:
            self._calls.popleft()[1].set_exception(RuntimeError("the scheduler stopped"))

    def dismiss_peers(self) -> None:
        """Tells the peers replaying this scheduler's calls to stop (Engine.close, last)."""
        if self.replicas is not None:
            self.replicas.stop()
            self.replicas = None

    def call(self, fn):
        """fn() on the device's owner: on the scheduler thread between two iterations while it
        runs (waiting for the result), else here."""
        if self.thread is None or threading.current_thread() is self.thread:
            return fn()
        future = concurrent.futures.Future()
        with self.wake:
            if not self.running:
                raise RuntimeError("the scheduler stopped")
            self._calls.append((fn, future))
            self.wake.notify()
        return future.result()

    def _run_calls(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            try:
                future.set_result(fn())
            except Exception as e:  # the caller gets it; serving goes on
                future.set_exception(e)
                if self._damaged():
                    log.error("a call over the decode state failed after donating it: %r", e)
                    self.recover()

    def run_until_idle(self) -> None:
        while self.step():
            pass

    # -- the loop --------------------------------------------------------------------------

    def _loop(self) -> None:
        while self.running:
            with self.wake:
                while (self.running and not self._calls and not self.queue and not self.active
                       and self._in_flight is None):
                    self.wake.wait()
            self._run_calls()
            if self.running:
                try:
                    self.step()
                except Exception:  # a failed step must not stop the serving
                    log.exception("a step failed: the requests in the lanes fail, the decode "
                                  "state is rebuilt")
                    self.recover()

    def step(self) -> bool:
        """One iteration; returns whether any work remains."""
        self._release_cancelled()
        self._make_room()
        self._admit()
        previous, self._in_flight = self._in_flight, self._dispatch(self._in_flight)
        if previous is not None:
            self._deliver(previous)  # waits for it; the step just queued keeps the device busy
        return bool(self.active or self.queue or self._in_flight)

    def _release_cancelled(self) -> None:
        for lane, handle in enumerate(self.lane_of):
            if handle is not None and handle.cancelled:
                self._finish(lane, "cancelled")
        with self.wake:
            cancelled = [h for h in self.queue if h.cancelled]
            for handle in cancelled:
                self.queue.remove(handle)
        for handle in cancelled:
            if handle.saved is not None and self.replicas is not None:
                self.replicas.send("forget", handle.saved.pages.peer_copy)  # the peers' copies
            handle.on_event(DoneEvent("cancelled", self._stats(handle)))

    # -- pages -----------------------------------------------------------------------------

    def _decoding(self, lane: int) -> bool:
        handle = self.lane_of[lane]
        return handle is not None and handle is not self._prefilling

    def _pages_wanted(self) -> int:
        """Pages the decoding lanes need beyond those they hold, for their next positions."""
        return sum(self.pages.shortfall(self.lane_of[lane].id, int(self.positions[lane]) + 1)
                   for lane in range(self.model.lanes) if self._decoding(lane))

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
        handle.saved = _Saved(self.read_sequence(held, lane), len(held),
                              int(self.positions[lane]), int(self.tokens[lane]))
        with self.wake:  # queued first: should vacating fail, it resumes after `recover`
            self.queue.appendleft(handle)
        self._release(lane)
        self.set_sampling(lane, SamplingParams())
        self.totals["preemptions"] += 1
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
            self.set_sampling(lane, handle.request.sampling)
            if handle.saved is not None:
                self._resume(lane, handle)
                continue
            self.pages.grow(handle.id, self._tokens_held(handle))
            handle.started_at = time.perf_counter()
            handle.cpu_picks_at_start = self.model.residency.cpu_picks()
            handle.approx_at_start = self.model.residency.approx_tally()
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
        self.write_sequence(pages[:saved.n_pages], lane, saved.pages)
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
        # a lane continues from its token in flight; one admitted or resumed since takes its
        # host token. Every step carries all lanes (none active while a lone prompt prefills):
        # one compiled step a chunk size, not two.
        fresh = np.array([previous is None or previous.handles[lane] is not handle
                          for lane, handle in enumerate(handles)])
        pages = [self.pages.grow(h.id, int(self.positions[lane]) + 1) if h else []
                 for lane, h in enumerate(handles)]
        decode = DecodeRows(self.tokens, fresh, np.where(active, self.positions, 0), active, pages)
        sampled = self.run_step(decode, chunk, previous.sampled.tokens if previous else None)
        self.positions[active] += 1
        self.totals["steps"] += 1
        produced = np.where(active, self.positions, 0)
        if chunk is not None and self._prefilling.prefilled == len(self._prefilling.request.prompt_ids):
            handles[chunk.lane] = self._prefilling  # its first token comes with this step
            self.positions[chunk.lane] = produced[chunk.lane] = chunk.start + len(chunk.tokens)
            self._prefilling = None
        for leaf in jax.tree.leaves(sampled) if _logprobs_wanted(handles) else [sampled.tokens]:
            leaf.copy_to_host_async()  # on its way as soon as the step ends
        return _Step(sampled, handles, produced)

    def _next_chunk(self) -> PrefillChunk | None:
        """The next prompt chunk of the prefilling request (marked written), or None."""
        handle = self._prefilling
        if handle is None:
            return None
        start = handle.prefilled
        prompt = handle.request.prompt_ids
        ids = prompt[start:start + self.model.chunk_length(start, len(prompt))]
        handle.prefilled += len(ids)
        return PrefillChunk(self.lane_of.index(handle), ids, start, self.pages.pages_of(handle.id))

    def _deliver(self, step: _Step) -> None:
        """Reads a step's tokens (waiting for the device) and emits them to the requests still in
        their lanes: not to one finished, cancelled or replaced since the step was queued."""
        tokens = np.asarray(step.sampled.tokens)
        sampled = jax.device_get(step.sampled) if _logprobs_wanted(step.handles) else None
        for lane, handle in enumerate(step.handles):
            if handle is not None and self.lane_of[lane] is handle:
                self._emit(lane, int(tokens[lane]), step.positions[lane],
                           _logprobs(sampled, lane, handle.request.sampling.logprobs))

    def _emit(self, lane: int, token: int, position: int, logprobs: dict) -> None:
        """Delivers `token` (at `position`, with its TokenEvent `logprobs` fields) for the
        request in `lane`, or ends it."""
        handle = self.lane_of[lane]
        request = handle.request
        if not handle.first_token_at:
            handle.first_token_at = time.perf_counter()
        if (token in request.stop_token_ids
                or (token in self.model.eos_ids and not request.ignore_eos)):
            self._finish(lane, "stop")
            return
        handle.generated += 1
        self.totals["generated_tokens"] += 1
        handle.on_event(TokenEvent(token, **logprobs))
        self.tokens[lane] = token
        if self._ends_by_length(handle, handle.generated, position):
            self._finish(lane, "length")

    def _ends_by_length(self, handle: RequestHandle, generated: int, position: int) -> bool:
        """Whether a request is done once it has `generated` tokens, the last at `position`."""
        return (generated >= handle.request.max_new_tokens
                or position + 1 >= self.model.max_context)

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
            "cold_share": self.model.residency.window_cold_share(),
            # picks the host CPU computed (miss policy "cpu") while it ran, beside lanes included
            "cpu_picks": self.model.residency.cpu_picks() - handle.cpu_picks_at_start,
            # the share of routing weight served approximately over the same steps
            "approx_weight_share": _share_since(self.model.residency.approx_tally(),
                                                handle.approx_at_start),
        }

    def _vacate(self, lane: int) -> None:
        """Frees a lane and its request's pages. The lane goes back to greedy first (greedy
        lanes keep all-greedy steps cheap): should that call fail, the request is still in
        its lane for `recover` to fail."""
        self.set_sampling(lane, SamplingParams())
        self._release(lane)

    def _release(self, lane: int) -> RequestHandle:
        """Frees a lane and its request's pages; no device call."""
        handle, self.lane_of[lane] = self.lane_of[lane], None
        if handle is self._prefilling:
            self._prefilling = None
        self.pages.release(handle.id)
        return handle

    # -- faults ----------------------------------------------------------------------------

    def _damaged(self) -> bool:
        """Whether a failed call left the state's buffers donated (deleted)."""
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(self.state))

    def recover(self) -> None:
        """After a failed step: every lane's request fails (STEP_FAILED), the steps in flight
        are dropped and the DecodeState is rebuilt (LoadedModel.rebuilt_state); the queue,
        preempted requests included (their pages are in host memory), is served on. `status`
        is "recovering" meanwhile; should the rebuild fail too, "failed": the queue fails, the
        loop stops and later requests are refused."""
        self.status = "recovering"
        self._in_flight = None
        for lane, handle in enumerate(self.lane_of):
            if handle is not None:
                self._release(lane).on_event(ErrorEvent(STEP_FAILED))
        if self.replicas is not None:  # the peers' states are not rebuilt with it
            log.error("a step failed across processes: the engine stops serving")
            self._fail_all()
            return
        try:
            self.state = self.model.rebuilt_state(self.state)
        except Exception:
            log.exception("rebuilding the decode state failed: the engine stops serving")
            self._fail_all()
            return
        self.status = "ready"
        log.info("the decode state is rebuilt; serving on (%d queued)", len(self.queue))

    def _fail_all(self) -> None:
        """Status "failed": the loop stops, the queue fails, later requests are refused."""
        self.status, self.running = "failed", False
        with self.wake:
            failed, self.queue = list(self.queue), collections.deque()
        for handle in failed:
            handle.on_event(ErrorEvent(STEP_FAILED))

    # -- the device: every jitted call over the state ------------------------------------------

    def _own(self) -> None:
        """The state is touched only by its owner: the scheduler thread while it runs."""
        if self.thread is not None and threading.current_thread() is not self.thread:
            raise RuntimeError("the scheduler thread owns the device: go through Scheduler.call")

    def run_step(self, decode: DecodeRows | None, prefill: PrefillChunk | None,
                 previous: jax.Array | None = None) -> Sampled:
        """Queues one step with residency's next swap batch and returns its Sampled (tokens
        [lanes] and their logprobs) on the device, not waiting for them: each decoding lane's
        next token and, where `prefill` is given, the token sampled after its chunk at
        prefill.lane (its request's first token when the chunk ends the prompt). A decoding
        lane's input is previous[lane] (an earlier step's output, still on the device) or, where
        decode.fresh[lane], decode.tokens[lane]."""
        residency = self.model.residency
        inputs = self.model.step_inputs(decode, prefill, previous, residency.next_batch())
        with jax.profiler.TraceAnnotation("decode" if prefill is None else "prefill"):
            sampled, tallies = self.dispatch(inputs)
        real = (len(prefill.tokens) if prefill is not None else 0) + (
            int(decode.active.sum()) if decode is not None else 0)
        residency.after_step(tallies, real)
        return sampled

    def dispatch(self, inputs) -> tuple:
        """The jitted step alone over the state (donated): (Sampled, Tallies). `run_step` is the
        serving path; benchmarks time this one bare."""
        self._own()
        if self.replicas is not None:
            self.replicas.send_step(inputs)
        sampled, self.state, tallies = self.model.steps.step(self.model.params, self.state, inputs)
        if self.replicas is not None:
            self.replicas.last_tokens = sampled.tokens
        return sampled, tallies

    def lower(self, inputs):
        """The jitted step lowered for `inputs` (cost analysis, HLO); the state is not consumed."""
        return self.model.steps.step.lower(self.model.params, self.state, inputs)

    def score(self, token_ids) -> np.ndarray:
        """A full forward over `token_ids` (a scratch cache of its own, with residency's next swap
        batch): logits [T, vocab] float32; only the expert state (its counters) changes."""
        self._own()
        residency = self.model.residency
        inputs, n = self.model.score_inputs(token_ids, residency.next_batch())
        logits, tallies = self.score_with(inputs)
        residency.after_step(tallies, n)
        logits = np.asarray(logits, np.float32)[0, :n]  # whole on every device: read here
        residency.flush()
        return logits

    def score_with(self, inputs) -> tuple:
        """The jitted scoring forward alone over the state: (logits, Tallies)."""
        self._own()
        if self.replicas is not None:
            self.replicas.send_score(inputs)
        logits, self.state, tallies = self.model.steps.score(self.model.params, self.state, inputs)
        return logits, tallies

    def warmup(self, prompt_lengths: list[int] | None = None) -> int:
        """Runs each step shape a request can meet (LoadedModel.warmup_shapes; with
        `prompt_lengths`, those prompts of these lengths meet) with every token masked out
        (nothing written, counted or sampled into a lane), each sequence copy preemption makes
        (read and written back unchanged) and the lanes' sampling update; returns how many
        steps."""
        self._own()
        shapes = self.model.warmup_shapes(prompt_lengths)
        batches = self.model.residency.warmup_batches()
        for size, prefill_width, decode_width in sorted(shapes, key=str):
            for idle in batches:
                self.dispatch(self.model.warmup_inputs(size, prefill_width, decode_width, idle))
        for n in self.model.sequence_sizes():
            self.write_sequence([0] * n, 0, self.read_sequence([0] * n, 0))
        self.set_sampling(0, SamplingParams())
        return len(shapes) * len(batches)

    def update_experts(self, fn) -> None:
        """The expert state through `fn(experts) -> experts` between steps: residency's
        between-step operations (reseed, drain, move_to, apply_swaps). Across processes only
        residency's reach the peers: each batch they apply, as it applies (Residency.on_apply)."""
        self._own()
        self.state = self.state.replace(experts=fn(self.state.experts))

    def set_sampling(self, lane: int, params: SamplingParams) -> None:
        """A lane's sampling parameters, set in the state, its token counts cleared (at
        admission; benchmarks)."""
        self._own()
        if self.replicas is not None:
            self.replicas.send("set_lane", lane, params)
        self.state = self.state.replace(sampling=self.model.steps.set_lane(
            self.state.sampling, np.int32(lane), LaneParams.of([params])))

    def read_sequence(self, pages: list[int], lane: int) -> SavedSequence:
        """What a preempted sequence keeps until it resumes, in host memory: its pages of the KV
        pool, its lane's rows (DeepSeek-V4.1's Engram look-back among them) and token counts (a
        steps.SavedSequence of numpy leaves; across processes each keeps its own shards of a
        leaf split over them, and the peers' copies are numbered in `peer_copy`)."""
        self._own()
        copy = None if self.replicas is None else self.replicas.send_read(pages, lane)
        saved = parallel.to_host(self.model.steps.read_sequence(
            self.state, np.asarray(pages, np.int32), np.int32(lane)))
        return dataclasses.replace(saved, peer_copy=copy)

    def write_sequence(self, pages: list[int], lane: int, saved: SavedSequence) -> None:
        """Puts what `read_sequence` read back: into the pool at `pages` and into the rows of
        `lane` (any lane: not necessarily the one it was read from)."""
        self._own()
        if self.replicas is not None:
            if saved.peer_copy is None:
                raise ValueError("across processes a saved sequence is written back from this "
                                 "engine's read_sequence: the peers hold their own copies of it")
            self.replicas.send("write", pages, lane, saved.peer_copy)
        cache, sampling = self.model.steps.write_sequence(
            self.state.cache, self.state.sampling, np.asarray(pages, np.int32), np.int32(lane),
            parallel.from_host(saved))
        self.state = self.state.replace(cache=cache, sampling=sampling)


def _logprobs_wanted(handles) -> bool:
    return any(h is not None and h.request.sampling.logprobs is not None for h in handles)


def _logprobs(sampled: Sampled | None, lane: int, top: int | None) -> dict:
    """A lane's TokenEvent logprob fields from a step's Sampled on the host ({} where its
    request asked for none)."""
    if top is None:
        return {}
    return {"logprob": float(sampled.logprob[lane]),
            "top": tuple(zip(sampled.top_ids[lane, :top].tolist(),
                             sampled.top_logprobs[lane, :top].tolist()))}
