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

Speculative decoding ([speculative] method "mtp": runtime/speculative.py): every step is a
verify step, each decoding lane's latest token and its k drafts, beside the prefilling prompt's
next chunk as a plain step carries it; the lane emits its kept drafts and the step's token, one
by one as a plain step's (so a stop or a length limit ends it there), then takes the last one's
position and gives back the pages past what it still needs. One step is in flight here too: a
lane that goes on takes its latest token and its position from the step before on the device
(steps.Latest), so how many drafts that step kept is not needed to queue the next; its pages
cover the most the lane can reach, every draft in flight kept and then the next step's writes
(its position + 2k: the drafts, and the MTP chain's keys after the last kept one). The host
learns the positions as it reads the steps, in order, so a step's token positions are known
when it is read. A lane whose request ends in the step in flight (a stop token, a length limit
reached by kept drafts) has the next step compute tokens nobody receives, as a stop token does
without speculation.

Preemption: when the pool runs short, the newest admitted request gives up its lane; its pages
and its lane's fixed rows (DeepSeek-V4.1's window rings and Engram look-back) are copied to host
memory and it waits at the head of the queue, to resume where it was (same positions, same
token, same sampling keys), in whatever lane is free, once pages are free again.

Events go to each request's `on_event` callback from the scheduler thread (the server turns them
into asyncio queue items with loop.call_soon_threadsafe).

The scheduler decides and the runner acts (vLLM v1's schedule -> execute -> update): each
iteration's decisions (sequences to save and restore, the lanes' sampling rows, the prompt
chunk, the decoding lanes, residency's swap batch) go into one StepPlan of plain data
(runtime/plan.py), which the Runner (runtime/runner.py), the one owner of the DecodeState and
caller of the jitted steps, carries out; the scheduler reads its StepResult (the tokens) an
iteration later. A device call asked for from another thread while the scheduler's thread runs
(`Engine.logits`) goes through `call`, which runs it on that thread between two iterations.

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

from tidejax.errors import EngineError, RequestError
from tidejax.kv.pages import PageTable, block_hashes
from tidejax.runtime.api import DoneEvent, ErrorEvent, GenerationRequest, TokenEvent
from tidejax.runtime.build import LoadedModel
from tidejax.runtime.plan import PageRestore, PageSpill, SequenceCopy, StepPlan
from tidejax.runtime.runner import Runner, StepResult
from tidejax.runtime.sampling import Sampled, SamplingParams
from tidejax.runtime.steps import DecodeRows, PrefillChunk, SavedSequence

log = logging.getLogger("tidejax")


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
        # its first row of a routing replay (LoadedModel.next_replay_window): its place among
        # the requests admitted since the replay was set times a stride coprime with the
        # trace's rows (steps.replay_stride), so each follows a window of the trace of its own,
        # token by token, however the steps carry its tokens
        self.window = 0
        self.prefilled = 0  # prompt tokens written to the cache
        self.cached = 0  # prompt tokens it found in the prompt cache (never prefilled)
        self.hashes: list[bytes] | None = None  # its prompt's full pages' block hashes
        self.output: list[int] = []  # the tokens delivered (their pages are cached at release)
        self.first_token_at = 0.0
        self.drafted = 0  # speculative decoding: drafts its verify steps judged
        self.accepted = 0  # and of them, those kept
        self.cpu_picks_at_start = 0  # the engine's host-computed picks when its prefill began
        self.approx_at_start = (0.0, 0.0)  # and its residency.approx_tally()
        self.saved: _Saved | None = None  # while preempted

    def cancel(self) -> None:
        """Frees the lane before the next step (safe from any thread)."""
        self.cancelled = True


@dataclasses.dataclass
class _Saved:
    """A preempted request's place: the number of its saved copy (its KV pages, its lane's rows
    and token counts, which the runners keep in host memory), the position and host token of its
    next step."""

    copy: int
    n_pages: int
    position: int
    token: int


@dataclasses.dataclass
class _Step:
    """A queued step whose tokens have not been read yet."""

    result: StepResult  # each lane's next token [lanes] and its logprobs, on the device
    handles: list  # [lanes] the request each lane's token belongs to; None: no token for it
    # [lanes] the position of the token the step gives each lane (a verify step's first) where
    # the host knows it when queueing the step: not of a lane that `continues`
    positions: np.ndarray
    drafted: np.ndarray | None = None  # a verify step's drafts judged per lane; else None
    # a verify step's lanes that go on from the step before it: their first token follows
    # the latest one that step's reading leaves them (Scheduler._first_positions)
    continues: np.ndarray | None = None


def _share_since(now: tuple[float, float], start: tuple[float, float]) -> float:
    """(part, whole) tallies now and at a start -> part / whole over what came between."""
    whole = now[1] - start[1]
    return (now[0] - start[0]) / whole if whole > 0 else 0.0


class Scheduler:
    def __init__(self, model: LoadedModel, runner: Runner):
        self.model = model
        self.runner = runner  # the DecodeState's owner: it carries out the plans
        self._plan = StepPlan()  # what the next plan carries, decided so far
        self._copies = itertools.count(1)  # numbers of the saved sequences
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
        # requests, prompt, prefilled, cached and generated tokens, steps, preemptions
        self.totals = collections.Counter()
        self.caching = model.prefix_caching  # prompts share cached pages (kv/pages.py)
        # a match restores its lane's rows from a snapshot (model.lane_snapshots)
        self.snapshots = model.lane_snapshots
        self.pages.spilling = self.tiers is not None  # evicted pages go to the tiers
        self._admissions = itertools.count(1)
        self._calls: collections.deque = collections.deque()  # (fn, Future) for the thread
        self.last_stats: dict = {}  # the stats of the request that finished last
        self.status = "ready"  # "recovering" while `recover` rebuilds the state; "failed" after
        self.failure = ""  # why the status is "failed"
        self.lost = ""  # a peer process found gone (peer_lost), for the loop to act on
        # speculative decoding: k drafts a lane (0: off); whether each lane's drafts are
        # current (a step that decoded it or ended its prompt drafted them); positions past a
        # lane's next that its steps write (the verify step's k drafts, the MTP chain's k - 1)
        self.k = model.speculating
        self.has_drafts = np.zeros(lanes, bool)
        self.lookahead = 2 * self.k if self.k else 1

    # -- API -------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, on_event) -> RequestHandle:
        n = len(request.prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        if n >= self.model.max_context:
            raise RequestError(f"the prompt has {n} tokens; this model's context is "
                               f"{self.model.max_context} tokens", "prompt")
        if request.max_new_tokens < 1:
            raise RequestError("max_new_tokens must be at least 1", "max_new_tokens")
        request.sampling.check_vocab(self.model.vocab_size)
        if self.status == "failed":
            raise EngineError("the engine failed and could not rebuild its state")
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
        """Pages in use, cached (held by no sequence, evicted when needed) and free (cached ones
        included), preemptions so far, beside the pool's size (the host and disk tiers' are in
        cache_stats)."""
        return dict(self.model.kv_stats(), preemptions=self.totals["preemptions"],
                    pages_in_use=self.pages.in_use, pages_free=self.pages.free,
                    pages_cached=self.pages.cached, lane_snapshots=self.pages.snapshots,
                    lane_snapshot_bytes=self.pages.snapshots * self.model.snapshot_bytes())

    def cache_stats(self) -> dict:
        """Counters of the prompt cache: prompt tokens matched (not prefilled), pages evicted from
        the device pool's index; `tiers`: both per tier (device, host, disk: the tokens of the
        tier process 0 restored them from, the pages process 0's tier evicted: each process
        evicts its own shards of the same pages); with the host and disk tiers on, `processes`:
        {process index: its tiers' Tiers.stats()} (a peer's as of its last report:
        Runner.tier_stats)."""
        out = {"matched_tokens": self.totals["cached_tokens"], "evictions": self.pages.evictions,
               "tiers": {"device": {"matched_tokens": self.totals["cached_device"],
                                    "evictions": self.pages.evictions}}}
        if self.tiers is not None:
            processes = self.runner.tier_stats()
            own = processes.get(jax.process_index(), {})
            for tier in ("host", "disk"):
                out["tiers"][tier] = {"matched_tokens": self.totals[f"cached_{tier}"],
                                      "evictions": own.get(tier, {}).get("evictions", 0)}
            out["processes"] = processes
        return out

    @property
    def tiers(self):
        """The prompt cache's host and disk tiers (kv/tiers.py; process 0's: each runner keeps
        its own) or None."""
        return self.runner.tiers

    def close_tiers(self) -> None:
        """The device pool's indexed pages (`_spill_indexed`) and the host tier's written to the
        disk tier and its writes waited for (Engine.close): a restart over the same folder
        matches them (each peer's at stop); the host tier's even where reading the pool fails."""
        try:
            if self.caching and self.tiers is not None and self.tiers.disk is not None:
                self._spill_indexed(self.tiers.disk)
        finally:
            self.runner.close_tiers()
            self.pages.spilling = False

    def _spill_indexed(self, disk) -> None:
        """The newest of the pool's indexed pages that `disk`'s budget holds, with their lane
        snapshots, spilled to the host tier oldest first (so the host tier's older entries, which
        it writes to disk before them, are the first the disk tier's budget deletes); one plan a
        sequence copy's worth, each runner waiting for its disk writes after it (host memory
        holds one read beyond the host tier). The pages stay indexed on the device."""
        indexed, room, chosen = self.pages.indexed(), disk.budget, []
        size = {kept: disk.entry_bytes(kept) for kept in (False, True)}  # with a snapshot or not
        for digest, page, snapshot in reversed(indexed):
            room -= size[snapshot is not None]
            if room < 0:
                break
            chosen.append((digest, page, snapshot))
        log.info("prompt cache: %d of the device pool's %d indexed pages go to disk at close "
                 "(the newest within cache.disk_gib)", len(chosen), len(indexed))
        chosen.reverse()  # oldest first
        most = self.model.max_pages  # the most pages one sequence copy reads
        for first in range(0, len(chosen), most):
            self._plan_spill(chosen[first:first + most], closing=True)
            self.runner.run(self._take())

    def start(self) -> None:
        """Runs the loop on a daemon thread (the server); without it, `run_until_idle` drives."""
        self.running = True
        self.thread = threading.Thread(target=self._loop, name="tidejax-scheduler", daemon=True)
        self.runner.owner = self.thread
        self.thread.start()

    def stop(self) -> None:
        self.running = False
        with self.wake:
            self.wake.notify()
        if self.thread:
            self.thread.join()
            self.thread = None
            self.runner.owner = None
        while self._calls:
            self._calls.popleft()[1].set_exception(RuntimeError("the scheduler stopped"))

    def call(self, fn):
        """fn() on the device's owner: on the scheduler thread between two iterations while it
        runs (waiting for the result), else here."""
        if self.thread is None or threading.current_thread() is self.thread:
            return self._call_here(fn)
        future = concurrent.futures.Future()
        with self.wake:
            if not self.running:
                raise RuntimeError("the scheduler stopped")
            self._calls.append((fn, future))
            self.wake.notify()
        return future.result()

    def _call_here(self, fn):
        """fn() on this thread; where it fails after donating the decode state (a scoring
        forward, say), the state is rebuilt (`recover`) before the caller gets the error."""
        try:
            return fn()
        except Exception as e:
            if self.runner.damaged():
                log.error("a call over the decode state failed after donating it: %r", e)
                self.recover()
            raise

    def _run_calls(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            try:
                future.set_result(self._call_here(fn))
            except Exception as e:  # the caller gets it; serving goes on
                future.set_exception(e)

    def run_until_idle(self) -> None:
        while self.step():
            pass

    # -- the loop --------------------------------------------------------------------------

    def _loop(self) -> None:
        while self.running:
            with self.wake:
                while (self.running and not self._calls and not self.queue and not self.active
                       and self._in_flight is None and self._plan.empty and not self.lost):
                    self.wake.wait()
            if self.lost:
                self._fail_lanes()
                self.fail(self.lost)
                break
            self._run_calls()
            if self.running:
                try:
                    self.step()
                except Exception:  # a failed step must not stop the serving
                    log.exception("a step failed: the requests in the lanes fail, the decode "
                                  "state is rebuilt")
                    self.recover()

    def step(self) -> bool:
        """One iteration; returns whether any work remains. Where none does, residency's
        tallies and drain still on their way are read (Residency.flush), so its stats, the
        history and /metrics at rest count every step served."""
        self._release_cancelled()
        self._make_room()
        self._admit()
        previous, self._in_flight = self._in_flight, self._dispatch(self._in_flight)
        if previous is not None:
            self._deliver(previous)  # waits for it; the step just queued keeps the device busy
        busy = bool(self.active or self.queue or self._in_flight or not self._plan.empty)
        if not busy:
            self.model.residency.flush()
        return busy

    def _release_cancelled(self) -> None:
        for lane, handle in enumerate(self.lane_of):
            if handle is not None and handle.cancelled:
                self._finish(lane, "cancelled")
        with self.wake:
            cancelled = [h for h in self.queue if h.cancelled]
            for handle in cancelled:
                self.queue.remove(handle)
        for handle in cancelled:
            if handle.saved is not None:
                self._plan.forget.append(handle.saved.copy)
            handle.on_event(DoneEvent("cancelled", self._stats(handle)))

    # -- pages -----------------------------------------------------------------------------

    def _decoding(self, lane: int) -> bool:
        handle = self.lane_of[lane]
        return handle is not None and handle is not self._prefilling

    def _pages_wanted(self) -> int:
        """Pages the decoding lanes need beyond those they hold, for their next positions."""
        upper = self._next_positions(self._in_flight)
        return sum(self.pages.shortfall(self.lane_of[lane].id, self._reach(upper[lane]))
                   for lane in range(self.model.lanes) if self._decoding(lane))

    def _next_positions(self, in_flight: _Step | None) -> np.ndarray:
        """[lanes] the position of each lane's next input token, or the most it can be: a lane
        the verify step in flight goes on with takes the position of that step's last kept
        token, at most its first token's + the drafts it judges."""
        upper = self.positions.copy()
        if in_flight is None or in_flight.drafted is None:
            return upper
        first = self._first_positions(in_flight)
        for lane, handle in enumerate(in_flight.handles):
            if handle is not None and self.lane_of[lane] is handle:
                upper[lane] = first[lane] + in_flight.drafted[lane]
        return upper

    def _first_positions(self, step: _Step) -> np.ndarray:
        """[lanes] the position of the first token `step` gives each lane. Of a lane it goes on
        with from the step before, that one's reading tells it: read in order, and before
        `step` is (so here, planning the step after `step`, or reading it), the lane's latest
        position is `step`'s input."""
        if step.continues is None:
            return step.positions
        return np.where(step.continues, self.positions + 1, step.positions)

    def _reach(self, position) -> int:
        """Positions a lane's pages cover for a step from `position`: the step's writes."""
        return min(int(position) + self.lookahead, self.model.max_context)

    def _make_room(self) -> None:
        """Preempts the newest requests until every decoding lane has a page for its next token.
        The step in flight is read first: a preempted request's pages must be final."""
        while self._pages_wanted() > self.pages.free:
            if self._in_flight is not None:
                step, self._in_flight = self._in_flight, None
                self._deliver(step)
                continue  # delivering may have finished requests and freed their pages
            newest = max((h for h in self.lane_of if h is not None), key=lambda h: h.admitted_at)
            self._preempt(self.lane_of.index(newest))

    def _preempt(self, lane: int) -> None:
        handle = self.lane_of[lane]
        held = self.pages.pages_of(handle.id)
        handle.saved = _Saved(self._save(held, lane), len(held), int(self.positions[lane]),
                              int(self.tokens[lane]))
        with self.wake:
            self.queue.appendleft(handle)
        self._vacate(lane)
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
                shared = self._match(handle)
                if not self._fits(handle, shared):
                    return
                self.queue.popleft()
            lane = self.lane_of.index(None)
            self.lane_of[lane] = handle
            handle.admitted_at = next(self._admissions)
            self.has_drafts[lane] = False
            if handle.saved is not None:
                self._plan.lanes[lane] = handle.request.sampling
                self._resume(lane, handle)
                continue
            handle.window = self.model.next_replay_window()
            self.pages.share(handle.id, shared)
            self.pages.grow(handle.id, self._tokens_held(handle))
            restored = self._restore(handle, lane, len(shared))  # may run the plan so far
            if self.snapshots and not restored:
                shared = self._fall_back(handle, shared)
            # its sampling row in the plan that marks the cached prompt tokens seen (`seen`)
            self._plan.lanes[lane] = handle.request.sampling
            handle.prefilled = handle.cached = (len(shared) + restored) * self.pages.page_size
            if handle.cached:
                self._plan.seen[lane] = handle.request.prompt_ids[:handle.cached]
            if shared and self.snapshots and not restored:  # the lane's rows at the match's end
                self._plan.writes.append(SequenceCopy(self.pages.snapshot_of(shared[-1]), (),
                                                      lane, keep=True))
            handle.started_at = time.perf_counter()
            handle.cpu_picks_at_start = self.model.residency.cpu_picks()
            handle.approx_at_start = self.model.residency.approx_tally()
            self._prefilling = handle
            self.totals["requests"] += 1
            self.totals["prompt_tokens"] += len(handle.request.prompt_ids)
            self.totals["cached_tokens"] += handle.cached
            self.totals["cached_device"] += len(shared) * self.pages.page_size

    def _match(self, handle: RequestHandle) -> list[int]:
        """The cached pages on the device a new request's prompt starts with. With lane
        snapshots a match ends at the last page boundary with a snapshot on any tier: past the
        whole device run where the host and disk tiers go on from it to a page with one
        (`_restore` restores those), else at the device run's last page with one."""
        if not self.caching:
            return []
        if handle.hashes is None:
            handle.hashes = block_hashes(handle.request.prompt_ids, self.pages.page_size)
        if handle.saved is not None:  # it resumes from its own copy
            return []
        pages = self.pages.match(self._matchable(handle))
        if not self.snapshots:
            return pages
        resumable = self.pages.resumable(pages)
        if len(resumable) == len(pages) or self._tier_run(handle, len(pages)):
            return pages
        return resumable

    def _matchable(self, handle: RequestHandle) -> list[bytes]:
        """The block hashes of a prompt's full pages before its last token, which a step must
        run for the first sampled token's logits."""
        return handle.hashes[:(len(handle.request.prompt_ids) - 1) // self.pages.page_size]

    def _tier_run(self, handle: RequestHandle, start: int) -> list[bytes]:
        """The block hashes of the run of a prompt's pages past its first `start` that process
        0's host and disk tiers hold (Tiers.run: with lane snapshots, up to its last with one)."""
        if self.tiers is None or not self.caching:
            return []
        return self.tiers.run(self._matchable(handle)[start:], self.snapshots)

    def _fall_back(self, handle: RequestHandle, shared: list[int]) -> list[int]:
        """A match whose device pages end without a lane snapshot, where the restore past them
        came back empty (an entry lost since `_match`, or not held by every process), ends at
        its last device page with one instead: the request gives back the pages past it
        (shared read-only) for pages of its own (`_fits` counted those)."""
        cut = self.pages.resumable(shared)
        if len(cut) < len(shared):
            self.pages.release(handle.id)
            self.pages.share(handle.id, cut)
            self.pages.grow(handle.id, self._tokens_held(handle))
        return cut

    def _restore(self, handle: RequestHandle, lane: int, start: int) -> int:
        """Matches a new request's prompt on past its `start` device pages in the host and disk
        tiers: the plan so far runs with a restore of the run process 0's tiers hold into the
        request's next pages, of which the runners write back as many as every process holds
        (Runner._restore); those are indexed on the device again, with lane snapshots each with
        its own (a later prompt may match a shorter run of them), the last one's written into
        the lane. How many."""
        digests = self._tier_run(handle, start)
        if not digests:
            return 0
        pages = self.pages.pages_of(handle.id)[start:start + len(digests)]
        numbers = tuple(next(self._copies) for _ in digests) if self.snapshots else None
        self._plan.restores.append(PageRestore(tuple(pages), tuple(digests), numbers))
        result = self.runner.run(self._take())
        n = len(result.restored)
        self.pages.publish(handle.id, handle.hashes[:start + n])
        kept = set(result.snapshots)  # the run's last page has one (Runner._restore)
        for i, copy in enumerate(numbers[:n] if self.snapshots else ()):
            if copy not in kept:
                continue
            attached = self.pages.attach(handle.hashes[start + i], copy)  # for later matches
            if i == n - 1:  # the lane's rows as they were at the run's end
                self._plan.writes.append(SequenceCopy(copy, (), lane, keep=attached))
            elif not attached:
                self._plan.forget.append(copy)
        for tier in result.restored:
            self.totals[f"cached_{tier}"] += self.pages.page_size
        return n

    def _fits(self, handle: RequestHandle, shared: list[int]) -> bool:
        """Whether the queue's head can take a lane now: one prompt prefills at a time, and the
        pool must hold, beside what the decoding lanes need next, the positions it will write
        (past the cached pages it `shared`, with lane snapshots past the last of them with one:
        where a restore comes back empty the match falls back there)."""
        prefilling = handle.prefilled < len(handle.request.prompt_ids)
        if prefilling and self._prefilling is not None:
            return False
        # with lane snapshots as if the match ended at its last device page with one, where a
        # restore that comes back empty falls back to (`_fall_back`)
        floor = self.pages.resumable(shared) if self.snapshots else shared
        need = self.pages.takes(self._tokens_held(handle), floor)
        return need + self._pages_wanted() <= self.pages.free

    def _tokens_held(self, handle: RequestHandle) -> int:
        """Positions a request's pages cover once (re)admitted: its whole prompt while it
        prefills, up to its next position once it decodes (and the lookahead's)."""
        if handle.saved is None or handle.prefilled < len(handle.request.prompt_ids):
            return self._reach(len(handle.request.prompt_ids))
        return self._reach(handle.saved.position)

    def _resume(self, lane: int, handle: RequestHandle) -> None:
        pages = self.pages.grow(handle.id, self._tokens_held(handle))
        saved, handle.saved = handle.saved, None
        self._plan.writes.append(SequenceCopy(saved.copy, tuple(pages[:saved.n_pages]), lane))
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
            first = self._first_positions(previous)
            for lane, handle in enumerate(handles):
                if (handle is not None and previous.handles[lane] is handle
                        and self._ends_by_length(handle, handle.generated + 1, first[lane])):
                    handles[lane] = None  # the token in flight is its last
        active = np.array([h is not None for h in handles])
        chunk = self._next_chunk()
        if not active.any() and chunk is None:
            if not self._plan.empty:  # saves, restores or lane resets without a step
                self.runner.run(self._take())
            return None
        # a lane continues from its token in flight; one admitted or resumed since takes its
        # host token. Every step carries all lanes (none active while a lone prompt prefills):
        # one compiled step a chunk size, not two.
        fresh = np.array([previous is None or previous.handles[lane] is not handle
                          for lane, handle in enumerate(handles)])
        sampled_for = list(handles)  # the request each lane's sampled token belongs to
        prompt = self._prefilling
        completes = chunk is not None and prompt.prefilled == len(prompt.request.prompt_ids)
        if completes:
            sampled_for[chunk.lane] = prompt  # its first token comes with this step
        if self.k:
            queued = self._queue_verify(sampled_for, active, fresh, chunk, previous)
        else:
            pages = [self.pages.grow(h.id, self._reach(self.positions[lane])) if h else []
                     for lane, h in enumerate(handles)]
            decode = DecodeRows(self.tokens.copy(), fresh, np.where(active, self.positions, 0),
                                active, pages, self._replay_windows())
            result = self.run_step(decode, chunk, previous.result.step if previous else None,
                                   logprobs=_logprobs_wanted(sampled_for))
            self.positions[active] += 1
            queued = _Step(result, sampled_for, np.where(active, self.positions, 0))
        self.totals["steps"] += 1
        if previous is not None:  # queued before the step before it was read
            self.totals["overlapped_steps"] += 1
        self.has_drafts |= active
        if completes:
            self.positions[chunk.lane] = queued.positions[chunk.lane] = (chunk.start
                                                                         + len(chunk.tokens))
            self._prefilling = None
            self.has_drafts[chunk.lane] = True
        if chunk is not None:
            self._snapshot(prompt, chunk.lane)
        return queued

    def _queue_verify(self, sampled_for: list, active: np.ndarray, fresh: np.ndarray,
                      chunk: PrefillChunk | None, previous: _Step | None) -> _Step:
        """Queues a verify step (speculating) over the `active` lanes, beside `chunk`: a lane
        with current drafts has them judged; one that goes on from `previous` takes its
        latest token and position from it on the device, its pages covering the most it can
        reach (_next_positions)."""
        upper = self._next_positions(previous)
        pages = [self.pages.grow(self.lane_of[lane].id, self._reach(upper[lane]))
                 if active[lane] else [] for lane in range(self.model.lanes)]
        drafted = np.where(active & self.has_drafts, self.k, 0).astype(np.int32)
        decode = DecodeRows(self.tokens.copy(), fresh, np.where(active & fresh, self.positions, 0),
                            active, pages, self._replay_windows(), drafted)
        result = self.run_step(decode, chunk, previous.result.step if previous else None,
                               logprobs=_logprobs_wanted(sampled_for))
        if chunk is not None and drafted.any():
            self.totals["verify_chunk_steps"] += 1  # drafts judged beside a prompt chunk
        return _Step(result, sampled_for, np.where(active & fresh, self.positions + 1, 0),
                     drafted, active & ~fresh)

    def _next_chunk(self) -> PrefillChunk | None:
        """The next prompt chunk of the prefilling request (marked written), or None."""
        handle = self._prefilling
        if handle is None:
            return None
        start = handle.prefilled
        prompt = handle.request.prompt_ids
        ids = prompt[start:start + self.model.chunk_length(start, len(prompt), handle.cached)]
        handle.prefilled += len(ids)
        self.totals["prefilled_tokens"] += len(ids)
        if self.caching:  # the chunk's full pages, for the prompts after it (its step runs first)
            self.pages.publish(handle.id, handle.hashes[:handle.prefilled // self.pages.page_size])
        following = prompt[handle.prefilled] if handle.prefilled < len(prompt) else -1
        return PrefillChunk(self.lane_of.index(handle), ids, start, self.pages.pages_of(handle.id),
                            prompt[:start], following, handle.window)

    def _replay_windows(self) -> np.ndarray:
        """[lanes] each lane's request's RequestHandle.window (0: no request)."""
        return np.array([h.window if h is not None else 0 for h in self.lane_of], np.int64)

    def _snapshot(self, handle: RequestHandle, lane: int) -> None:
        """After the step of a prompt chunk that ends a page (published): the lane's rows and
        token counts read into host memory by the next plan (its reads run first, so they see
        what the chunk left), kept with that page's index entry for the prompts that match up
        to there, where the page has none yet (lane_snapshots)."""
        size = self.pages.page_size
        if not (self.caching and self.snapshots and handle.prefilled % size == 0):
            return
        copy = next(self._copies)
        if self.pages.attach(handle.hashes[handle.prefilled // size - 1], copy):
            self._plan.reads.append(SequenceCopy(copy, (), lane))

    def _deliver(self, step: _Step) -> None:
        """Reads a step's tokens (waiting for the device) and emits them to the requests still in
        their lanes: not to one finished, cancelled or replaced since the step was queued."""
        if step.drafted is not None:
            self._deliver_verified(step)
            return
        tokens = step.result.tokens()
        sampled = step.result.logprobs() if _logprobs_wanted(step.handles) else None
        for lane, handle in enumerate(step.handles):
            if handle is not None and self.lane_of[lane] is handle:
                self._emit(lane, int(tokens[lane]), step.positions[lane],
                           _logprobs(sampled, lane, handle.request.sampling.logprobs))

    def _deliver_verified(self, step: _Step) -> None:
        """A verify step's tokens: each lane's kept drafts and the step's own token after them,
        emitted in order until its request ends (a stop token, max_new_tokens, the context: the
        rest are dropped); a lane that goes on takes the position of its last token, and the
        pages past what it still needs go back (they held only rejected drafts' keys): past
        its next position, or where the step in flight goes on with it, past that step's
        writes."""
        tokens, accepted = step.result.tokens(), np.asarray(step.result.accepted)
        sampled = step.result.logprobs() if _logprobs_wanted(step.handles) else None
        first = self._first_positions(step)
        for lane, handle in enumerate(step.handles):
            if handle is None or self.lane_of[lane] is not handle:
                continue
            kept = int(accepted[lane])
            handle.drafted += int(step.drafted[lane])
            handle.accepted += kept
            self.totals["drafted_tokens"] += int(step.drafted[lane])
            self.totals["accepted_tokens"] += kept
            for j in range(kept + 1):
                at = None if sampled is None else jax.tree.map(lambda a: a[:, j], sampled)
                self._emit(lane, int(tokens[lane, j]), first[lane] + j,
                           _logprobs(at, lane, handle.request.sampling.logprobs))
                if self.lane_of[lane] is not handle:
                    break
            else:
                self.positions[lane] = first[lane] + kept
                in_flight = self._in_flight is not None and self._in_flight.handles[lane] is handle
                self.pages.shrink(handle.id, self._reach(self.positions[lane]) if in_flight
                                  else int(self.positions[lane]) + 1)

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
        handle.output.append(token)
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
            "cached_tokens": handle.cached,  # of them, found in the prompt cache
            "completion_tokens": handle.generated,
            "ttft_s": handle.first_token_at - handle.submitted if handle.first_token_at else 0.0,
            # the tokens its steps prefilled (not those found in the prompt cache)
            "prefill_tps": (prompt - handle.cached) / prefill_s if prefill_s > 0 else 0.0,
            "decode_tps": decoded / decode_s if decode_s and decoded else 0.0,
            "cold_share": self.model.residency.window_cold_share(),
            # picks the host CPU computed (miss policy "cpu") while it ran, beside lanes included
            "cpu_picks": self.model.residency.cpu_picks() - handle.cpu_picks_at_start,
            # the share of routing weight served approximately over the same steps
            "approx_weight_share": _share_since(self.model.residency.approx_tally(),
                                                handle.approx_at_start),
            **self._speculation_stats(handle.drafted, handle.accepted),
        }

    def _speculation_stats(self, drafted: int, accepted: int) -> dict:
        """Speculative decoding's drafts judged, those kept and their share ({} when off)."""
        if not self.k:
            return {}
        return {"drafted_tokens": drafted, "accepted_tokens": accepted,
                "acceptance": accepted / drafted if drafted else 0.0}

    def speculative_stats(self) -> dict:
        """_speculation_stats over every request since start (/metrics)."""
        return self._speculation_stats(self.totals["drafted_tokens"],
                                       self.totals["accepted_tokens"])

    def _vacate(self, lane: int) -> None:
        """Frees a lane and its request's pages; the next plan sets the lane back to greedy
        (greedy lanes keep all-greedy steps cheap)."""
        self._plan.lanes[lane] = SamplingParams()
        self._release(lane)

    def _release(self, lane: int) -> RequestHandle:
        """Frees a lane and its request's pages, its sampling row left as it is; the full pages
        of the tokens its steps wrote stay cached (prompt and generated tokens)."""
        handle, self.lane_of[lane] = self.lane_of[lane], None
        if handle is self._prefilling:
            self._prefilling = None
        if self.caching:
            self.pages.publish(handle.id, self._written_hashes(handle, lane))
        self.pages.release(handle.id)
        return handle

    def _written_hashes(self, handle: RequestHandle, lane: int) -> list[bytes]:
        """The block hashes of a request's full pages that its queued steps write: its prompt's
        up to what is prefilled, then, once it decodes, each delivered token a step took as
        input (positions below the lane's next; a stop token taken is none of them)."""
        prompt = handle.request.prompt_ids
        if handle.prefilled < len(prompt):
            written = handle.prefilled
        else:
            written = min(len(prompt) + len(handle.output), int(self.positions[lane]))
        size = self.pages.page_size
        if written < len(prompt):
            return handle.hashes[:written // size]
        return block_hashes(prompt + handle.output[:written - len(prompt)], size,
                            handle.hashes[:written // size])

    # -- faults ----------------------------------------------------------------------------

    def recover(self) -> None:
        """After a failed step: every lane's request fails (STEP_FAILED), the steps in flight
        are dropped and the runner rebuilds the DecodeState (Runner.rebuild); the queue,
        preempted requests included (their pages are in host memory), is served on. `status`
        is "recovering" meanwhile; should the rebuild fail too (or the engine span processes),
        "failed": the queue fails, the loop stops and later requests are refused."""
        self.status = "recovering"
        self._fail_lanes()
        self.pages.drop_cached()  # the rebuilt cache holds none of their keys
        try:
            self.runner.rebuild()
        except Exception:
            log.exception("rebuilding the decode state failed")
            self.fail(self.runner.peers_lost() or "the decode state could not be rebuilt after "
                      "a failed step (the log has the details)")
            return
        self.status = "ready"
        log.info("the decode state is rebuilt; serving on (%d queued)", len(self.queue))

    def _fail_lanes(self) -> None:
        """Every lane's request fails (STEP_FAILED); the steps in flight are dropped."""
        self._in_flight = None
        for lane, handle in enumerate(self.lane_of):
            if handle is not None:
                self._release(lane).on_event(ErrorEvent(STEP_FAILED))

    def peer_lost(self, reason: str) -> None:
        """A peer process is gone (the channel's pings, on their thread): the loop fails the
        lanes' requests and stops serving at its next turn (`fail`)."""
        with self.wake:
            self.lost = reason
            self.wake.notify_all()

    def fail(self, reason: str) -> None:
        """Status "failed" for `reason`: the loop stops, the queue fails, later requests are
        refused."""
        if self.status != "failed":
            log.error("the engine stops serving: %s", reason)
        self.status, self.failure, self.running = "failed", reason, False
        with self.wake:
            failed, self.queue = list(self.queue), collections.deque()
            self.wake.notify_all()
        for handle in failed:
            handle.on_event(ErrorEvent(STEP_FAILED))

    # -- plans: what the runner carries out ---------------------------------------------------

    def _take(self, **parts) -> StepPlan:
        """The plan decided so far with `parts` (its device call) added; the next starts empty."""
        self._plan_spills()
        self._plan.forget += self.pages.take_dropped()  # snapshots whose page left the index
        plan, self._plan = dataclasses.replace(self._plan, **parts), StepPlan()
        return plan

    def _plan_spills(self) -> None:
        """The pages the pool evicted since the last plan, read out by this one (its reads run
        before its step writes them again) and put in the runners' host tiers under their block
        hashes, each with its lane snapshot; the runners forget both copies then."""
        spilled = self.pages.take_spilled()
        most = self.model.max_pages  # the most pages one sequence copy reads
        for first in range(0, len(spilled), most):
            self._plan_spill(spilled[first:first + most])
        self._plan.forget += [n for _, _, n in spilled if n is not None]

    def _plan_spill(self, spilled: list[tuple[bytes, int, int | None]],
                    closing: bool = False) -> None:
        """A read of `spilled`'s pages (block hash, page, snapshot number or None; at most a
        sequence copy's) and their spill to the host tier (`closing`: PageSpill's); the read is
        forgotten after the plan."""
        digests, pages, snapshots = zip(*spilled)
        copy = next(self._copies)
        self._plan.reads.append(SequenceCopy(copy, pages, 0))
        self._plan.spills.append(PageSpill(copy, digests, snapshots, closing))
        self._plan.forget.append(copy)

    def _save(self, pages: list[int], lane: int) -> int:
        """Plans a read of a sequence's pages and lane rows into host memory; its copy's number."""
        copy = next(self._copies)
        self._plan.reads.append(SequenceCopy(copy, tuple(pages), lane))
        return copy

    def run_step(self, decode: DecodeRows | None, prefill: PrefillChunk | None,
                 previous: int | None = None, logprobs: bool = False) -> StepResult:
        """Runs the plan so far with one step and residency's next swap batch; its StepResult
        holds the step's Sampled (tokens [lanes] and their logprobs) on the device, not waited
        for: each decoding lane's next token and, where `prefill` is given, the token sampled
        after its chunk at prefill.lane (its request's first token when the chunk ends the
        prompt). A decoding lane's input is the token step `previous` sampled for it (still on
        the device) or, where decode.fresh[lane], decode.tokens[lane]."""
        residency = self.model.residency
        plan = self._take(decode=decode, prefill=prefill, previous=previous,
                          swaps=residency.next_batch(), logprobs=logprobs)
        result = self.runner.run(plan)
        residency.after_step(result.tallies, plan.routed)
        return result

    def score(self, token_ids) -> np.ndarray:
        """A full forward over `token_ids` (a scratch cache of its own, with residency's next swap
        batch): logits [T, vocab] float32; only the expert state (its counters) changes."""
        residency = self.model.residency
        ids = np.asarray(token_ids, np.int32).reshape(-1)
        result = self.runner.run(self._take(score=ids, swaps=residency.next_batch()))
        residency.after_step(result.tallies, len(ids))
        logits = result.scores()[:len(ids)]
        residency.flush()
        return logits

    def warmup(self, prompt_lengths: list[int] | None = None) -> int:
        """Runs each step shape a request can meet (LoadedModel.warmup_shapes; with
        `prompt_lengths`, those prompts of these lengths meet) with every token masked out
        (nothing written, counted or sampled into a lane), each sequence copy preemption makes
        (read and written back unchanged), with the tiers each page restore, and the lanes'
        sampling update; returns how many
        steps."""
        shapes = self.model.warmup_shapes(prompt_lengths)
        batches = self.model.residency.warmup_batches()
        warmups = [(shape, idle) for shape in sorted(shapes, key=str) for idle in batches]
        self.runner.precompile(warmups)
        for shape, idle in warmups:
            self.runner.run(self._take(warmup=shape, swaps=idle))
        for n in self.model.sequence_sizes():
            saved = self.read_sequence([0] * n, 0)
            if self.tiers is not None:  # a restore of n prompt-cache pages (as they are)
                self._plan.restores.append(PageRestore((0,) * n, copy=saved.copy))
            self.write_sequence([0] * n, 0, saved)
        self._plan.lanes[0] = SamplingParams()  # the lanes' sampling update
        self.runner.run(self._take())
        return len(shapes) * len(batches)

    def read_sequence(self, pages: list[int], lane: int) -> SavedSequence:
        """What a preempted sequence keeps until it resumes, in host memory: its pages of the KV
        pool, its lane's rows (DeepSeek-V4.1's Engram look-back among them) and token counts (a
        steps.SavedSequence of numpy leaves; the runners keep it under its `copy` number until
        `write_sequence` puts it back)."""
        copy = self._save(pages, lane)
        return self.runner.run(self._take()).saved[copy]

    def write_sequence(self, pages: list[int], lane: int, saved: SavedSequence) -> None:
        """Puts what `read_sequence` read back: into the pool at `pages` and into the rows of
        `lane` (any lane: not necessarily the one it was read from)."""
        self._plan.writes.append(SequenceCopy(saved.copy, tuple(pages), lane))
        self.runner.run(self._take())


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
