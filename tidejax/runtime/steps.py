"""The jitted steps: pure functions over (params, state, inputs), the DecodeState donated.

    step(params, state, StepInputs) -> (Sampled, state, Tallies)  (a DonatingStep)
        residency's swap batch applied at the start (residency.swap.apply_batch, which also
        starts the ring's copies: residency/ring.py); then the
        prompt chunk, written into the cache and marked seen in its lane's token counts (its
        last real token's sample goes to its lane); then every decoding lane's next token, its
        input token counted first; the counters' Tallies at the end. Sampled holds the tokens
        [lanes] and their log-probabilities.
    verify(params, state, VerifyInputs) -> ((Sampled [lanes, k + 1], accepted [lanes], Latest),
        state, Tallies)  (a DonatingStep; speculative decoding, runtime/speculative.py: with a
        Speculator every step is a verify step, its params (params, the MTP layer's params);
        the MTP layer routes through the same expert state, its last layer)
        the prompt chunk as in `step`, plus the MTP layer's keys over it and, for a prompt's
        last chunk, the lane's first drafts; then every decoding lane's latest token and its k
        drafts judged in one forward, and the next drafts. Latest: each lane's last kept token
        and its position, the next verify step's inputs on the device.
    score(params, state, ScoreInputs) -> (logits [1, T, vocab], state, Tallies)
        a full forward over a scratch cache of its own; only the expert state changes.
    read_sequence(state, pages, lane) -> SavedSequence: a preempted sequence's pages of the
        pool, its lane's rows and its lane's token counts; write_sequence(cache, sampling, pages,
        lane, saved) -> (cache, sampling) puts them back (at any lane). Both compile once per
        power of two of pages (the page ids padded past the pool).
    The cache is a kv.paged.PagedCache: the pool, written through block tables, and each lane's
    fixed rows; a prompt chunk reads and writes back its lane's slice of the rows.
    write_pages(pool, pages, rows) -> pool: prompt-cache pages back into the pool alone
        (kv/tiers.py), compiled per power of two of pages as well; write_pinned the same from
        pages in pinned host memory, which read_pages(pool, pages) -> [page, ...] reads out.
    set_lane(sampling, lane, row, seen): one lane's sampling parameters, its token counts
        cleared, at admission (but for `seen`: a cached prefix's prompt tokens).

The host views a StepPlan carries (DecodeRows, PrefillChunk: runtime/plan.py) become the array
inputs here (DecodeInputs, PrefillInputs) in runtime/build.py.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tidejax import parallel
from tidejax.kv.paged import PagedCache
from tidejax.kv.pages import page_bucket
from tidejax.residency.swap import SwapBatch, apply_batch, finish_batch
from tidejax.runtime.sampling import LaneParams, LaneSampling, lane_keys, sample
from tidejax.runtime.speculative import Speculator
from tidejax.runtime.state import DecodeState


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeInputs:
    """A step's decoding lanes, as arrays: tokens, fresh, previous, positions, active [lanes];
    table [lanes, P] block tables."""

    tokens: jax.Array
    fresh: jax.Array
    previous: jax.Array
    positions: jax.Array
    active: jax.Array
    table: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillInputs:
    """A step's prompt chunk, as arrays: tokens, positions, mask [1, C]; lane and last (the
    chunk's last real token) scalars; table [1, P]; rows: what the family reads for it on the
    host (Family.prompt_rows), or None."""

    tokens: jax.Array
    positions: jax.Array
    mask: jax.Array
    lane: jax.Array
    last: jax.Array
    table: jax.Array
    rows: object = None
    # with speculation: the prompt token after the chunk, or -1 where the chunk ends the prompt
    # (then the token sampled after it): the MTP layer's input at the chunk's last position
    following: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Latest:
    """Each lane's latest token and its position after a verify step, [lanes] int32 each: where
    the lane goes on, the next verify step's input, kept on the device, so that the host queues
    that step before it reads how many drafts this one kept (the step in flight)."""

    tokens: jax.Array
    positions: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VerifyInputs:
    """A verify step (speculative decoding): each lane's latest token and its position [lanes]
    from the host where fresh [lanes], else from the last verify step's `previous` (Latest, on
    the device); active [lanes]; drafted [lanes] int32: how many of the lane's drafts in the
    state are current (k, or 0: it decodes one token); table [lanes, P]; the prompt chunk
    beside them (or None); swaps and replay as in StepInputs (the MTP layer's picks from it:
    Replay.mtp_ids)."""

    tokens: jax.Array
    fresh: jax.Array
    positions: jax.Array
    previous: Latest
    active: jax.Array
    drafted: jax.Array
    table: jax.Array
    prefill: PrefillInputs | None
    swaps: SwapBatch
    replay: Replay | None = None


def replay_stride(max_context: int, rows: int) -> int:
    """The trace rows between consecutive requests' windows in a routing replay of N = `rows`
    rows: the smallest s >= max_context coprime with N, so a request's tokens (max_context at
    most) end before the next request's window where N allows, and N admissions in a row take N
    distinct windows (a stride s sharing a factor g with N would give only N / g of them: 4 for
    max_context 1024 on a trace of 4096 rows, one for any multiple of 4096). Only consecutive
    windows are s apart: wrapping around N, a later one may fall a few rows from an earlier one
    (1025 on 4096 rows: 0, 1025, 2050, 3075, 4, ...), so lanes admitted N // s apart route by
    nearly the same rows a few positions apart; at max_context >= N every window is one row on
    from the last."""
    return next(s for s in itertools.count(max(max_context, 1)) if math.gcd(s, rows) == 1)


def replay_windows(admissions, max_context: int, rows: int) -> np.ndarray:
    """The windows (RequestHandle.window) of the requests admitted `admissions`-th (0: the first
    since the replay was set; an int or an array of them): a * replay_stride mod N."""
    return np.asarray(admissions, np.int64) * replay_stride(max_context, rows) % rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Replay:
    """Recorded routing keyed by the token: picks [N, L_moe, k] expert ids (on the device, sent
    once); windows [rows] each forward row's first trace row (its request's window,
    RequestHandle.window: replay_windows), so the token at position p of a row routes by row
    (window + p) mod N whatever step carries it: a verify step's positions n..n + k take the rows
    plain steps give them, and a rejected draft's row is taken again by the token that replaces
    it. A prompt prefix served from the prompt cache is not recomputed: its KV was written under
    the window of the request that prefilled it, so with the prompt cache on a request's output
    can differ from its output with the cache off (the benchmarks turn the cache off)."""

    picks: jax.Array
    windows: jax.Array

    def ids(self, positions):
        """The picks of a forward at positions [b, t] (row i of it the window's row i):
        [b, t, L_moe, k]."""
        rows = (self.windows[:, None] + positions) % self.picks.shape[0]
        return self.picks[rows]

    def mtp_ids(self, positions):
        """The MTP layer's picks at positions [b, t]: the last main MoE layer's of the token at
        each position (the trace has no row for the MTP layer; the one it drafts from is the
        main model's hidden state at p) -> [b, t, k]."""
        return self.ids(positions)[:, :, -1]

    def row(self, lane) -> "Replay":
        """The replay of one lane (a prompt chunk's): windows [1]."""
        return Replay(self.picks, jax.lax.dynamic_slice_in_dim(self.windows, lane, 1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    """One step's inputs: the prompt chunk and the decoding lanes (either may be None), the
    family's step tables (Family.step_tables: the same arrays every step; None where it has
    none), the routing replay (windows [lanes]; None: the routers choose) and residency's swap
    batch for the step's start."""

    prefill: PrefillInputs | None
    decode: DecodeInputs | None
    tables: object
    replay: Replay | None
    swaps: SwapBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ScoreInputs:
    """A scoring forward: tokens, positions, mask [1, T]; cache: a scratch cache for the
    sequence alone (a PagedCache: its pages and one lane's rows); table [1, P] its pages in it;
    step tables and swap batch as in StepInputs; replay: windows [1], window 0 (the sequence's
    token at position p routes by row p mod N)."""

    tokens: jax.Array
    positions: jax.Array
    mask: jax.Array
    cache: PagedCache
    table: jax.Array
    tables: object
    replay: Replay | None
    swaps: SwapBatch


@dataclasses.dataclass
class DecodeRows:
    """The scheduler's view of a step's decoding lanes (host values, [lanes] each); pages: each
    lane's KV pages, a lane's list covering its next position."""

    tokens: np.ndarray
    fresh: np.ndarray
    positions: np.ndarray
    active: np.ndarray
    pages: list[list[int]] | None = None
    # each lane's request's first row of a routing replay (RequestHandle.window; None: 0)
    windows: np.ndarray | None = None
    # a verify step (speculative decoding) where not None: the drafts each lane has current
    # (k; 0 for a lane resumed since its last step, which then decodes one token)
    drafted: np.ndarray | None = None


@dataclasses.dataclass
class PrefillChunk:
    """A prompt chunk for `lane`: tokens at positions start..; pages: the request's KV pages,
    covering the chunk."""

    lane: int
    tokens: list[int]
    start: int
    pages: list[int] | None = None
    context: list[int] = dataclasses.field(default_factory=list)  # the tokens before start
    following: int = -1  # the prompt's token after the chunk; -1: the chunk ends the prompt
    window: int = 0  # its request's first row of a routing replay (RequestHandle.window)


class DonatingStep:
    """A jitted fn(params, state, inputs) -> (out, state, tallies) with the DecodeState donated
    but for its expert rows no step writes (ExpertState.rows: the host pool, or the bank where
    every expert is resident), which go in beside it, not donated, and come back as they went.
    So a step that fails after its buffers were donated leaves them whole, and the runner
    rebuilds the state from them (Scheduler.recover, Runner.rebuild).

    A compiled executable kept for some inputs' shapes (`keep`: one read from disk,
    runtime/executables.py) is called in place of the jitted function for inputs of those
    shapes; `traces` counts the times fn was traced (none on a warm restart from them)."""

    def __init__(self, fn):
        def apart(params, rows, state: DecodeState, inputs):
            self.traces += 1  # runs only while jax traces it
            out, state, tallies = fn(params, _with_rows(state, rows), inputs)
            return out, state.replace(experts=state.experts.without_rows()), tallies
        self.name = fn.__name__
        self.traces = 0
        self.jitted = jax.jit(apart, donate_argnames=("state",), keep_unused=True)
        self.kept: dict[tuple, object] = {}  # inputs' shapes -> a jax.stages.Compiled

    @staticmethod
    def shared(params, state: DecodeState) -> tuple:
        """What the jitted function takes before its inputs, whatever they are: (params, expert
        rows, state without them)."""
        return params, state.experts.rows, state.replace(experts=state.experts.without_rows())

    @staticmethod
    def arguments(params, state: DecodeState, inputs) -> tuple:
        """What the jitted function takes: (params, expert rows, state without them, inputs)."""
        return (*DonatingStep.shared(params, state), inputs)

    def __call__(self, params, state: DecodeState, inputs):
        args = self.arguments(params, state, inputs)
        compiled = self.kept.get(_shapes(inputs)) if self.kept else None
        out, new, tallies = (compiled or self.jitted)(*args)
        return out, _with_rows(new, args[1]), tallies

    def lower(self, params, state: DecodeState, inputs):
        return self.jitted.lower(*self.arguments(params, state, inputs))

    def keep(self, inputs, compiled) -> None:
        """Calls with inputs of `inputs`'s shapes go to `compiled` (this function lowered and
        compiled for them, with the params and state it is called with) from now on."""
        self.kept[_shapes(inputs)] = compiled


def _shapes(inputs) -> tuple:
    """The tree structure and each leaf's shape and dtype (a Python scalar: its type)."""
    leaves, tree = jax.tree.flatten(inputs)
    return tree, tuple((getattr(leaf, "shape", ()), getattr(leaf, "dtype", type(leaf)))
                       for leaf in leaves)


def _with_rows(state: DecodeState, rows: dict) -> DecodeState:
    return state.replace(experts=state.experts.with_rows(rows))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["cache", "counts", "seen"],
                   meta_fields=[], drop_fields=["copy"])
@dataclasses.dataclass
class SavedSequence:
    """What a preempted sequence keeps of the state: its pages of the pool and its lane's rows
    (a PagedCache), its lane's token counts [vocab] int32 and seen [vocab] bool. Across processes
    each keeps its own copy (parallel.to_host: a process holds only its shards of KV pages split
    by heads); `copy` is the number the runners keep it under (runtime/plan.py; not a leaf)."""

    cache: PagedCache
    counts: jax.Array
    seen: jax.Array
    copy: int | None = None


@dataclasses.dataclass
class Steps:
    """The jitted functions over one model (a flax module: see models/registry.Family.build).
    `step` and `score` (DonatingSteps) keep unused inputs (keep_unused), so every leaf of the
    donated state is donated, also those a step overwrites unread (the `auto` policy's threshold
    and count)."""

    model: object
    max_pages: int  # the most pages a sequence holds (max_context)
    # speculative decoding (runtime/speculative.py) where set: the steps are `verify` steps,
    # their params (params, the MTP layer's params)
    speculator: Speculator | None = None

    def _forward(self, params, tables, tokens, positions, mask, cache, table, experts, routes,
                 logits_at=None, rows=None):
        """tables: the family's step tables or None; routes: replayed picks [b, t, L_moe, k] or
        None; logits_at [b]: the one position of each row to compute logits at (None: all);
        rows: a prompt chunk's host-read rows (Family.prompt_rows) or None. -> (logits, cache,
        experts, the head's hidden state [b, t, d] where speculating, else None)."""
        extra = () if tables is None else (tables,)
        optional = {} if routes is None else {"replay": routes}  # a family may take neither
        if rows is not None:
            optional["prompt_rows"] = rows
        args = ({"params": params}, tokens, positions, mask, cache, table, experts, *extra)
        hidden = None
        if self.speculator is None:
            logits, cache, experts = self.model.apply(*args, **optional, logits_at=logits_at)
        else:
            (logits, cache, experts), seen = self.model.apply(
                *args, **optional, logits_at=logits_at, mutable=["intermediates"])
            hidden = seen["intermediates"]["head_hidden"][0]
        if experts.picks is not None:  # the next forward's picks follow these tokens'
            experts = experts.replace(picks=experts.picks.advanced(tokens.size))
        return logits, cache, experts, hidden

    def _prefill(self, params, tables, chunk: PrefillInputs, cache: PagedCache, experts, routes):
        """The logits [1, 1, vocab] at the chunk's last token (and _forward's hidden state): it
        writes the shared pool through its block table and its lane's slice of the per-lane
        rows."""
        lane = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, chunk.lane, 1, 0), cache.lanes)
        logits, out, experts, hidden = self._forward(
            params, tables, chunk.tokens, chunk.positions, chunk.mask,
            PagedCache(cache.pages, lane), chunk.table, experts, routes,
            jnp.reshape(chunk.last, (1,)), chunk.rows)
        lanes = jax.tree.map(lambda a, u: jax.lax.dynamic_update_slice_in_dim(a, u, chunk.lane, 0),
                             cache.lanes, out.lanes)
        return logits, PagedCache(out.pages, lanes), experts, hidden

    def _draft(self, draft: dict, hidden, next_tokens, positions, mask, at, cache, table,
               experts, sampling: LaneSampling, replay: Replay | None):
        """The MTP layer (params `draft`) over rows the step ran (Speculator.draft), its keys
        written into the pool, its picks through `experts` (replayed: Replay.mtp_ids); each
        row's random key from its seed and its position `at` -> (drafts [b, k], q [b, k, v],
        cache, experts)."""
        rows = jnp.arange(hidden.shape[0])
        keys = lane_keys(sampling.params.seed, positions[rows, at])
        drafts, q, out, experts = self.speculator.draft(
            draft, hidden, next_tokens, positions, mask, at, PagedCache(cache.pages), table,
            experts, sampling, keys, replay)
        return drafts, q, PagedCache(out.pages, cache.lanes), experts

    def _chunk(self, params, draft: dict | None, tables, prefill: PrefillInputs,
               cache: PagedCache, experts, replay: Replay | None, sampling: LaneSampling):
        """The prompt chunk: written into the cache (routed by its lane's row of `replay`
        where one is given), its tokens marked seen in its lane's counts, the token after its
        last sampled (Sampled [1]: the request's first token where the chunk ends the prompt);
        with `draft`, the MTP layer's keys of its positions (the token after each: the prompt's
        next, after the last the one sampled) and drafts from its last -> (first, (drafts
        [1, k], q [1, k, v]) or None, cache, experts, sampling)."""
        replay = replay.row(prefill.lane) if replay is not None else None
        routes = replay.ids(prefill.positions) if replay is not None else None
        logits, cache, experts, hidden = self._prefill(params, tables, prefill, cache, experts,
                                                       routes)
        sampling = sampling.saw_prompt(prefill.lane, prefill.tokens[0], prefill.mask[0])
        first = sample(logits[:, 0], sampling.lane(prefill.lane),
                       prefill.positions[:, prefill.last] + 1)
        if draft is None:
            return first, None, cache, experts, sampling
        after = jnp.where(prefill.following >= 0, prefill.following, first.tokens[0])
        following = jnp.roll(prefill.tokens, -1, axis=1).at[0, prefill.last].set(after)
        drafts, q, cache, experts = self._draft(
            draft, hidden, following, prefill.positions, prefill.mask,
            jnp.reshape(prefill.last, (1,)), cache, prefill.table, experts,
            sampling.lane(prefill.lane), replay)
        return first, (drafts, q), cache, experts, sampling

    @functools.cached_property
    def step(self):
        def step(params, state: DecodeState, inputs: StepInputs):
            prefill, decode, replay = inputs.prefill, inputs.decode, inputs.replay
            cache, sampling = state.cache, state.sampling
            experts = apply_batch(state.experts, inputs.swaps)
            lanes = sampling.counts.shape[0]
            if prefill is not None:
                first, _, cache, experts, sampling = self._chunk(
                    params, None, inputs.tables, prefill, cache, experts, replay, sampling)
            if decode is not None:
                tokens = jnp.where(decode.fresh, decode.tokens, decode.previous)  # [lanes]
                sampling = sampling.generated(tokens, decode.active)
                routes = replay.ids(decode.positions[:, None]) if replay is not None else None
                logits, cache, experts, _ = self._forward(
                    params, inputs.tables, tokens[:, None], decode.positions[:, None],
                    decode.active[:, None], cache, decode.table, experts, routes)
                out = sample(logits[:, 0], sampling, decode.positions + 1)
            else:
                out = jax.tree.map(lambda a: jnp.zeros((lanes, *a.shape[1:]), a.dtype), first)
            if prefill is not None:
                out = out.at(prefill.lane, first)
            experts, tallies = finish_batch(experts, inputs.swaps)
            return out, DecodeState(cache, experts, sampling, state.drafts), tallies
        return DonatingStep(step)

    @functools.cached_property
    def verify(self):
        """The verify step of speculative decoding (runtime/speculative.py): the prompt chunk
        (`_chunk`, drafting), then every decoding lane's latest token and its k drafts at
        k + 1 positions, judged by `accept`, then the next drafts -> ((Sampled [lanes, k + 1],
        accepted [lanes], Latest), state, tallies); a lane emits its tokens 0..accepted, the
        chunk's lane its first token at 0 (accepted 0)."""
        spec = self.speculator
        width = jnp.arange(spec.k + 1)[None]

        def verify(params, state: DecodeState, inputs: VerifyInputs):
            params, draft = params
            cache, sampling, drafts = state.cache, state.sampling, state.drafts
            experts = apply_batch(state.experts, inputs.swaps)
            chunk, replay = inputs.prefill, inputs.replay
            if chunk is not None:  # no step tables: the speculating families have none
                first, (chunk_drafts, chunk_q), cache, experts, sampling = self._chunk(
                    params, draft, None, chunk, cache, experts, replay, sampling)
            latest = jnp.where(inputs.fresh, inputs.tokens, inputs.previous.tokens)  # [lanes]
            start = jnp.where(inputs.fresh, inputs.positions, inputs.previous.positions)
            tokens = jnp.concatenate([latest[:, None], drafts.tokens], 1)
            positions = start[:, None] + width  # [lanes, k + 1]
            mask = inputs.active[:, None] & (width <= inputs.drafted[:, None])
            keys = lane_keys(sampling.params.seed, start)
            verdict, sampled, new, q, out, experts, sampling = spec.verify(
                params, draft, tokens, positions, mask, drafts.q, PagedCache(cache.pages),
                inputs.table, experts, sampling, keys, replay)
            cache = PagedCache(out.pages, cache.lanes)
            drafts = drafts.put(inputs.active, new, q)
            rows = jnp.arange(latest.shape[0])
            accepted = verdict.accepted
            after = Latest(verdict.tokens[rows, accepted], start + accepted + 1)
            if chunk is not None:  # its lane's first token, drafts and place
                at = rows == chunk.lane
                sampled = jax.tree.map(lambda a, r: a.at[chunk.lane, 0].set(r[0]), sampled, first)
                accepted = jnp.where(at, 0, accepted)
                drafts = drafts.put(at, jnp.broadcast_to(chunk_drafts, drafts.tokens.shape),
                                    jnp.broadcast_to(chunk_q, drafts.q.shape))
                end = chunk.positions[0, chunk.last] + 1
                after = Latest(jnp.where(at, first.tokens[0], after.tokens),
                               jnp.where(at, end, after.positions))
            experts, tallies = finish_batch(experts, inputs.swaps)
            return ((sampled, accepted, after), DecodeState(cache, experts, sampling, drafts),
                    tallies)
        return DonatingStep(verify)

    @functools.cached_property
    def score(self):
        def score(params, state: DecodeState, inputs: ScoreInputs):
            experts = apply_batch(state.experts, inputs.swaps)
            replay = inputs.replay
            routes = replay.ids(inputs.positions) if replay is not None else None
            if self.speculator is not None:
                params = params[0]
            logits, _, experts, _ = self._forward(params, inputs.tables, inputs.tokens,
                                                  inputs.positions, inputs.mask, inputs.cache,
                                                  inputs.table, experts, routes)
            experts, tallies = finish_batch(experts, inputs.swaps)
            return logits, state.replace(experts=experts), tallies
        return DonatingStep(score)

    def read_sequence(self, state: DecodeState, pages, lane) -> SavedSequence:
        """A sequence's `pages` [n] of the pool (padded to _padded's length with zeros), its
        lane's rows and token counts."""
        return self._read(state, _padded(pages, self.max_pages), lane)

    def copy_shapes(self, state: DecodeState, shardings: bool) -> SavedSequence:
        """A one-page read_sequence's leaves as jax.ShapeDtypeStruct; with `shardings`, those its
        compiled read gives them (compiled, not run)."""
        args = (state, np.zeros(1, np.int32), np.int32(0))
        shapes = jax.eval_shape(self._read, *args)
        if not shardings:
            return shapes
        return jax.tree.map(lambda shape, where: jax.ShapeDtypeStruct(
            shape.shape, shape.dtype, sharding=where), shapes,
            self._read.lower(*args).compile().output_shardings)

    def write_sequence(self, cache: PagedCache, sampling: LaneSampling, pages, lane,
                       saved: SavedSequence) -> tuple[PagedCache, LaneSampling]:
        """`saved` (read_sequence's, as many pages) back at `pages` [n] and `lane`; cache and
        sampling donated."""
        return self._write(cache, sampling, _padded(pages, self.max_pages), lane, saved)

    @functools.cached_property
    def _read(self):
        def read(state: DecodeState, pages, lane):
            cache, sampling = state.cache, state.sampling
            rows = lambda leaf: leaf.at[pages].get(mode="fill", fill_value=0)
            return SavedSequence(PagedCache(jax.tree.map(rows, cache.pages),
                                            jax.tree.map(lambda leaf: leaf[lane], cache.lanes)),
                                 sampling.counts[lane], sampling.seen[lane])
        return jax.jit(read)

    @functools.cached_property
    def _write(self):
        def write(cache: PagedCache, sampling: LaneSampling, pages, lane, saved: SavedSequence):
            def put(at):
                return lambda leaf, rows: leaf.at[at].set(rows.astype(leaf.dtype), mode="drop")
            cache = PagedCache(jax.tree.map(put(pages), cache.pages, saved.cache.pages),
                               jax.tree.map(put(lane), cache.lanes, saved.cache.lanes))
            counts = sampling.counts.at[lane].set(saved.counts)
            seen = sampling.seen.at[lane].set(saved.seen)
            return cache, dataclasses.replace(sampling, counts=counts, seen=seen)
        return jax.jit(write, donate_argnames=("cache", "sampling"))

    def write_pages(self, pool, pages, rows: list):
        """Pool rows at `pages` [n]: prompt-cache pages back from host memory or disk
        (kv/tiers.py). `rows`: trees like the pool's of [k, page_size, ...] leaves (numpy, or this
        process's parallel.LocalShards), n rows in all, in order; the pool donated."""
        at = _padded(pages, self.max_pages)
        stacked = jax.tree.map(lambda *leaves: parallel.stack_rows(leaves, len(at)), *rows)
        return self._write_pages(pool, at, parallel.from_host(stacked))

    @functools.cached_property
    def _write_pages(self):
        return jax.jit(_put_pages, donate_argnames=("pool",))

    def read_pages(self, pool, pages) -> list:
        """Pool rows at `pages` [n] on the device, a tree like the pool's of [1, page_size, ...]
        leaves a page (the prompt cache's spill: Runner._read_pages); PINNED_GROUP pages a call,
        compiled per power of two up to it."""
        out, group = [], min(PINNED_GROUP, self.max_pages)
        for first in range(0, len(pages), group):
            part = pages[first:first + group]
            out += self._read_pages(pool, _padded(part, group))[:len(part)]
        return out

    @functools.cached_property
    def _read_pages(self):
        def read_pages(pool, pages):
            rows = jax.tree.map(lambda leaf: leaf.at[pages].get(mode="fill", fill_value=0), pool)
            return [jax.tree.map(lambda leaf: leaf[i:i + 1], rows) for i in range(len(pages))]
        return jax.jit(read_pages)

    def write_pinned(self, pool, pages, rows: list):
        """write_pages of `rows` in pinned host memory, a tree of [1, page_size, ...] leaves a
        page: each copied to the device inside the write, never stacked on the host;
        PINNED_GROUP pages a call, as read_pages."""
        group = min(PINNED_GROUP, self.max_pages)
        for first in range(0, len(pages), group):
            at = _padded(pages[first:first + group], group)
            part = list(rows[first:first + group])
            part += [part[-1]] * (len(at) - len(part))  # at page ids past the pool: dropped
            pool = self._write_pinned(pool, at, part)
        return pool

    @functools.cached_property
    def _write_pinned(self):
        def write_pinned(pool, pages, rows):
            stacked = jax.tree.map(lambda *leaves: jnp.concatenate(
                [parallel.to_device(leaf) for leaf in leaves]), *rows)
            return _put_pages(pool, pages, stacked)
        return jax.jit(write_pinned, donate_argnames=("pool",))

    @functools.cached_property
    def set_lane(self):
        def set_lane(sampling: LaneSampling, lane, row: LaneParams, seen):
            return sampling.set_lane(lane, row, seen)
        return jax.jit(set_lane, donate_argnames=("sampling",))


def _put_pages(pool, pages, rows):
    """Inside a jit: `rows` (the pool's tree, leaves [len(pages), ...]) into the pool at
    `pages`; those past the pool dropped."""
    return jax.tree.map(lambda leaf, r: leaf.at[pages].set(r.astype(leaf.dtype), mode="drop"),
                        pool, rows)


# pages a pinned read or write (the prompt cache's host tier) takes a call: its jit has a tree of
# the pool's leaves a page, so all of a long sequence's pages (hundreds, at ~100 leaves at 40
# layers) would make one program of tens of thousands of arguments, compiled at warm-up
PINNED_GROUP = 8
PAST_THE_POOL = np.iinfo(np.int32).max  # a page id no pool has: reads give zeros, writes drop


def _padded(pages, max_pages: int) -> np.ndarray:
    """Page ids [n] -> [page_bucket(n, max_pages)], padded with PAST_THE_POOL: a sequence copy
    compiles once per power of two of pages (LoadedModel.sequence_sizes), not per page count."""
    pages = np.asarray(pages, np.int32)
    out = np.full(page_bucket(len(pages), max_pages), PAST_THE_POOL, np.int32)
    out[:len(pages)] = pages
    return out
