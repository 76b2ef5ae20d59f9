"""The engine: a loaded model, its KV cache and expert state, and the jitted step over them.

One step carries every decoding lane's next token and, beside them, up to `prefill_chunk` prompt
tokens of one admitting request, so a long prompt never stalls the decoding lanes for more than a
step. Shapes are static: a prompt chunk is padded to a few bucket sizes, decode always runs all
lanes, and the block tables are as wide as the step's longest sequence needs (a power of two of
pages), so attention costs what the sequences hold and each (bucket, width) compiles once. The
cache is a kv.paged.PagedCache: the family's KV pool, shared by every sequence through its block
table, and the fixed-size rows each lane keeps (DeepSeek-V4.1's window rings), which a prompt chunk
reads and writes at its lane. The KV cache and the expert state are donated into every step and come back updated in
place. A step returns its tokens on the device without waiting for them, and takes each lane's
input from the previous step's output there, so the scheduler can queue the next step before it
reads this one's tokens.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tidejax import parallel
from tidejax.config import EngineConfig
from tidejax.fields import ConfigError, read_json
from tidejax.runtime.sampling import LaneSampling, SamplingParams, sample
from tidejax.text.tokenizer import Tokenizer
from tidejax.kv.paged import PagedCache
from tidejax.kv.pages import page_bucket, pages_for
from tidejax.pallas.attention import pallas_supports as paged_mla_supports
from tidejax.pallas.dispatch import choose_impl
from tidejax.models.loading import ExpertPool
from tidejax.models.registry import family_for
from tidejax.residency.manager import Residency
from tidejax.residency.serve import ServeOptions

log = logging.getLogger("tidejax")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. Der schnelle braune Fuchs springt. "
    "Le renard brun saute par-dessus le chien. def main(argv):\n    return 0\n"
    "for f in *.txt; do echo \"$f\"; done\nNAME\n    ls - list directory contents\n")


def _buckets(limit: int) -> list[int]:
    sizes, size = [], 16
    while size < limit:
        sizes.append(size)
        size *= 2
    return sizes + [limit]


class Engine:
    """Load with `tidejax.load(...)`. Thread-safety: one thread drives the steps (the scheduler's
    when serving); `generate` and `logits` run on the caller's thread when no server runs."""

    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir = Path(config.model.path)
        if not config.model.path or not (model_dir / "config.json").exists():
            raise ConfigError(f"{config.source}: 'model.path' = {config.model.path!r} is not a "
                              "checkpoint directory (no config.json)")
        raw = read_json(model_dir / "config.json")
        source = str(model_dir / "config.json")
        self.family = family_for(raw, source)
        self.cfg = self.family.config_from_hf(raw, source)
        self.tokenizer = Tokenizer(model_dir)
        self.model_dir = model_dir
        self.served_name = config.model.served_name or model_dir.name
        self.dtype = _DTYPES[config.model.dtype]
        self.lanes = config.engine.lanes
        self.max_context = config.engine.max_context
        if self.max_context > self._max_positions():
            log.warning("%s: engine.max_context %d is above the model's max_position_embeddings; "
                        "serving %d", config.source, self.max_context, self._max_positions())
            self.max_context = self._max_positions()
        self.prefill_chunk = min(config.engine.prefill_chunk, self.max_context)
        self.eos_ids = end_of_turn_ids(model_dir, getattr(self.cfg, "eos_token_ids", ()),
                                       self.tokenizer.eos_id)
        self.serve = ServeOptions(
            miss_policy=config.residency.miss_policy, kernel=config.engine.kernel,
            swiglu_limit=float(self.family.swiglu_limit(self.cfg)), count=config.residency.count)

        n_moe, n_experts = self.family.expert_dims(self.cfg)[:2]
        pool = ExpertPool(n_moe * n_experts, config.model.experts, self.dtype)
        self.params, self._aux = self.family.load_weights(
            self.cfg, model_dir, raw, self.serve, self.dtype, pool.put_row)
        pool = pool.result()
        self.residency = Residency(
            pool, self.family.expert_dims(self.cfg)[0], self.family.top_k(self.cfg),
            config.residency, kernel=config.engine.kernel, swiglu_limit=self.serve.swiglu_limit,
            max_tokens=self.max_context)
        self.serve = self.residency.options
        self.model = self.family.build(self.cfg, self.serve, self.dtype)
        self.page_size = config.engine.page_size
        self.kv_pages = self._pool_pages(config)
        self.max_pages = pages_for(self.max_context, self.page_size)
        self.decode_attention = self._decode_attention(config.engine.kernel)
        cache = self._new_cache(self.kv_pages, self.lanes)
        log.info("KV pool: %d pages of %d tokens (%.2f GiB), %d bytes a lane beside it",
                 self.kv_pages, self.page_size,
                 self.kv_pages * self.page_size * self.cache_bytes_per_token() / 2**30,
                 self.lane_bytes())
        # committed to the device, as the steps return it: one compile per step, not two
        axes = self.family.cache_axes
        self.cache = PagedCache(
            parallel.put(cache.pages, axes(cache.pages)) if axes else parallel.replicated(cache.pages),
            parallel.replicated(cache.lanes))
        self._prefill_buckets = _buckets(self.prefill_chunk)
        replay = self.family.replay_variables
        self._steps = _Steps(self.model, functools.partial(replay, self.cfg) if replay else None)
        self._replay: jax.Array | None = None  # [N, L_moe, k] recorded picks on the device
        self._replay_cursor = 0  # the row the next token routes by
        self._lane_inputs = self.family.host_inputs(self.cfg, self._aux, self.lanes)
        # the `previous` tokens of a step that takes every input from the host (committed to the
        # device, as a step's output is: one compilation)
        self._host_only = parallel.replicated(np.zeros(self.lanes, np.int32))
        from tidejax.runtime.scheduler import Scheduler  # circular at import time only
        self.scheduler = Scheduler(self)
        if self.residency.needs_calibration:
            self._calibrate()
        self.trace_dir = config.engine.trace_dir
        if self.trace_dir:
            # no Python tracer: its events (compilation, mostly) would crowd out the regions
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0
            jax.profiler.start_trace(self.trace_dir, profiler_options=options)
            atexit.register(self.close)
            log.info("writing a JAX profiler trace to %s (regions: prefill, decode, drain, plan, "
                     "swap)", self.trace_dir)

    def close(self) -> None:
        """Finishes the profiler trace, if one is being written."""
        if self.trace_dir:
            jax.profiler.stop_trace()
            self.trace_dir = ""

    # -- loading ---------------------------------------------------------------------------

    def _max_positions(self) -> int:
        return getattr(self.cfg, "max_position_embeddings", 1 << 30)

    def _decode_attention(self, kernel: str) -> str:
        """The paged decode attention the steps will trace ("pallas" reads only each lane's own
        pages, so its block tables can be full width): the kernel's own choice for the shapes
        of this model's latent cache (MLA), "reference" where the family's decode reads whole
        block tables."""
        if not self.family.mla_decode:
            return "reference"

        def struct(*shape):
            return jax.ShapeDtypeStruct(shape, self.dtype)
        latent = struct(1, self.page_size, self.cfg.kv_lora_rank)
        return choose_impl("paged_mla_decode", kernel, lambda: paged_mla_supports(
            struct(1, 1, self.cfg.kv_lora_rank), struct(1, 1, self.cfg.qk_rope_head_dim), latent))

    def _pool_pages(self, config: EngineConfig) -> int:
        """Pages in the KV pool: engine.kv_pool_gib, else engine.kv_pool_tokens, else room for
        every lane at max_context. The pool must hold one sequence at max_context."""
        section, size = config.engine, self.page_size
        if size < 1:
            raise ConfigError(f"{config.source}: 'engine.page_size' must be at least 1")
        multiple = self.family.page_multiple(self.cfg)
        if size % multiple:
            raise ConfigError(f"{config.source}: 'engine.page_size' = {size} must be a multiple of "
                              f"{multiple} for {self.family.name} (a page holds whole groups of "
                              "every compressed KV source)")
        if section.kv_pool_gib > 0 and self.cache_bytes_per_token() > 0:
            key = "engine.kv_pool_gib"
            pages = int(section.kv_pool_gib * 2**30 // (self.cache_bytes_per_token() * size))
        elif section.kv_pool_tokens > 0:
            key, pages = "engine.kv_pool_tokens", pages_for(section.kv_pool_tokens, size)
        else:
            key, pages = "engine.lanes", pages_for(self.lanes * self.max_context, size)
        if pages < pages_for(self.max_context, size):
            raise ConfigError(f"{config.source}: '{key}' gives a KV pool of {pages * size} tokens, "
                              f"less than one sequence at engine.max_context ({self.max_context})")
        return pages

    def _new_cache(self, n_pages: int, lanes: int) -> PagedCache:
        """A zeroed cache: a pool of n_pages pages and the rows of `lanes` lanes."""
        return PagedCache(self.family.create_cache(self.cfg, n_pages, self.page_size, self.dtype),
                          self.family.create_lane_cache(self.cfg, lanes, self.max_context,
                                                        self.dtype))

    def _calibrate(self) -> None:
        """No seed map and no history: seat the experts a short mixed prompt wants most."""
        ids = self.tokenizer.encode(CALIBRATION_TEXT)[: self.prefill_chunk]
        self.logits(ids)
        self.residency.reseed()

    # -- steps -----------------------------------------------------------------------------

    def chunks(self, token_ids: list[int]) -> list[tuple[int, list[int]]]:
        """(start, ids) of each prefill chunk of a prompt."""
        return [(start, token_ids[start:start + self.prefill_chunk])
                for start in range(0, len(token_ids), self.prefill_chunk)]

    def bucket(self, n: int) -> int:
        """The compiled prefill size that holds a chunk of n tokens."""
        return next(b for b in self._prefill_buckets if b >= n)

    @property
    def pipelined(self) -> bool:
        """Whether a step can take its input tokens from the previous step's output on the
        device. Not where the family computes host inputs from the token ids (DeepSeek-V4.1's
        Engram hashes): then every token must be on the host before its step."""
        return self._lane_inputs is None

    def step(self, decode: DecodeRows | None, prefill: PrefillChunk | None,
             sampling: LaneSampling, previous: jax.Array | None = None) -> jax.Array:
        """Queues one step and returns its tokens [lanes] on the device, not waiting for them: each
        decoding lane's next token and, where `prefill` is given, the token sampled after its
        chunk at prefill.lane (its request's first token when the chunk ends the prompt).
        A decoding lane's input is previous[lane] (an earlier step's output, still on the device)
        or, where decode.fresh[lane], decode.tokens[lane] from the host."""
        region = "decode" if prefill is None else "prefill"
        with jax.profiler.TraceAnnotation(region):
            tokens, self.cache, self.residency.state = self._steps.step(
                *self.step_args(decode, prefill, sampling, previous))
        real = (len(prefill.tokens) if prefill is not None else 0) + (
            int(decode.active.sum()) if decode is not None else 0)
        self.residency.after_step(real)
        return tokens

    def step_args(self, decode: DecodeRows | None, prefill: PrefillChunk | None,
                  sampling: LaneSampling, previous: jax.Array | None = None) -> tuple:
        """The jitted step's arguments for `step` (its block tables, padded chunk, host inputs,
        replay rows); benchmarks and tests lower the step with them."""
        if decode is None and prefill is None:
            raise ValueError("a step needs decoding lanes or a prompt chunk")
        if previous is None:
            previous = self._host_only
            if decode is not None and not decode.fresh.all():
                raise ValueError("a step without `previous` takes every input from the host")
        elif not self.pipelined:
            raise ValueError(f"the {self.family.name} family needs every input token on the host")
        prefill_in = prefill_host = None
        if prefill is not None:
            if not 0 < len(prefill.tokens) <= self.prefill_chunk:
                raise ValueError(f"a prompt chunk holds 1..{self.prefill_chunk} tokens, "
                                 f"got {len(prefill.tokens)}")
            prefill_in, prefill_host = self._prefill_inputs(prefill, self._prefill_width(prefill))
        decode_in = decode_host = None
        if decode is not None:
            decode_in = DecodeInputs(
                tokens=decode.tokens.astype(np.int32), fresh=decode.fresh.astype(bool),
                previous=previous, positions=decode.positions.astype(np.int32),
                active=decode.active.astype(bool),
                table=self._table(decode.pages, self._decode_width(decode)))
            if self._lane_inputs:
                decode_host = self._lane_inputs.rows(decode.tokens[:, None], decode.positions,
                                                     decode.active[:, None])
        replay_prefill = self._replay_rows(prefill_in.tokens.size) if prefill is not None else None
        replay_decode = self._replay_rows(self.lanes) if decode is not None else None
        return (self.params, replay_prefill, replay_decode, prefill_host, decode_host, prefill_in,
                decode_in, self.cache, self.residency.state, sampling)

    def _decode_width(self, decode: DecodeRows) -> int:
        """Block-table width of a step's decoding lanes: a power of two of pages, enough for the
        longest lane, where attention reads the whole table (the reference); the pool's longest
        sequence where the paged decode kernel reads each lane's own pages (one compile)."""
        if self.decode_attention == "pallas":
            return self.max_pages
        return page_bucket(max((len(p) for p in decode.pages), default=1), self.max_pages)

    def _prefill_width(self, prefill: PrefillChunk) -> int:
        """Block-table width of a prompt chunk: its request's pages (reserved for the whole
        prompt at admission, so every chunk of a prompt compiles once), as a power of two."""
        return page_bucket(len(prefill.pages), self.max_pages)

    def _table(self, pages: list[list[int]], width: int) -> np.ndarray:
        """Block tables [rows, width]: each row's pages, padded with page 0 (never read: past each
        row's length)."""
        table = np.zeros((len(pages), width), np.int32)
        for row, held in enumerate(pages):
            table[row, :len(held)] = held[:width]
        return table

    def _prefill_inputs(self, prefill: PrefillChunk, width: int):
        n, size = len(prefill.tokens), self.bucket(len(prefill.tokens))
        tokens = np.zeros((1, size), np.int32)
        tokens[0, :n] = prefill.tokens
        mask = (np.arange(size) < n)[None]
        inputs = PrefillInputs(
            tokens=tokens, positions=np.arange(prefill.start, prefill.start + size, dtype=np.int32)[None],
            mask=mask, lane=np.int32(prefill.lane), last=np.int32(n - 1),
            table=self._table([prefill.pages], width))
        host = (self._lane_inputs.rows(tokens, [prefill.start], mask, lanes=[prefill.lane])
                if self._lane_inputs else None)
        return inputs, host

    def set_prefill_chunk(self, tokens: int) -> None:
        """Prompt tokens a step carries from now on (benchmarks sweep it on one loaded model)."""
        if not 0 < tokens <= self.max_context:
            raise ValueError(f"prefill_chunk must be in 1..{self.max_context}, got {tokens}")
        self.prefill_chunk = tokens
        self._prefill_buckets = _buckets(tokens)

    def read_sequence(self, pages: list[int], lane: int) -> tuple:
        """What a preempted sequence keeps until it resumes, in host memory: its pages of the KV
        pool and its lane's rows (a PagedCache of numpy leaves [n, rows, ...] and [...]), and
        its lane's host-input state (DeepSeek-V4.1's Engram history; None without one)."""
        rows = jax.device_get(self._steps.read_sequence(self.cache, np.asarray(pages, np.int32),
                                                        np.int32(lane)))
        return rows, self._lane_inputs.read_lane(lane) if self._lane_inputs else None

    def write_sequence(self, pages: list[int], lane: int, saved: tuple) -> None:
        """Puts what `read_sequence` read back: into the pool at `pages` and into the rows and
        host-input state of `lane` (any lane: not necessarily the one it was read from)."""
        rows, host = saved
        self.cache = self._steps.write_sequence(self.cache, np.asarray(pages, np.int32),
                                                np.int32(lane), rows)
        if self._lane_inputs:
            self._lane_inputs.write_lane(lane, host)

    def logits(self, token_ids) -> np.ndarray:
        """A full forward over `token_ids` (a fresh cache): logits [T, vocab] float32."""
        ids = np.asarray(token_ids, np.int32).reshape(-1)
        n = len(ids)
        size = max(16, 1 << (n - 1).bit_length())  # powers of two: few compiles for any length
        tokens = np.zeros((1, size), np.int32)
        tokens[0, :n] = ids
        n_pages = pages_for(size, self.page_size)  # a pool of its own, the pages in order
        cache = self._new_cache(n_pages, 1)
        table = np.arange(n_pages, dtype=np.int32)[None]
        mask = (np.arange(size) < n)[None]
        scoring_inputs = self.family.host_inputs(self.cfg, self._aux, 1)
        inputs = scoring_inputs.rows(tokens, [0], mask) if scoring_inputs else None
        logits, experts = self._steps.score(
            self.params, self._replay_rows(tokens.size), inputs, tokens,
            np.arange(size, dtype=np.int32)[None], mask, cache, table, self.residency.state)
        self.residency.state = experts
        self.residency.after_step(n)
        logits = np.asarray(logits[0, :n], np.float32)
        self.residency.flush()
        return logits

    def warmup(self, prompt_lengths: list[int] | None = None) -> None:
        """Compiles the steps that prompts of `prompt_lengths` tokens meet (default: one chunk of
        each size) before traffic arrives: each chunk beside the lanes, and the decode step at
        the table width of the prompt's end, by running them with every token masked out:
        nothing is written, counted or sampled into a lane."""
        start = time.perf_counter()
        shapes = set()  # (chunk size or 0, prefill table width, decode table width)
        for n in prompt_lengths or self._prefill_buckets:
            held = [0] * pages_for(min(n + 1, self.max_context), self.page_size)
            prefill_width = self._prefill_width(PrefillChunk(0, [0], 0, held))
            decode_width = self._decode_width(DecodeRows(*[None] * 4, pages=[held]))
            for _, chunk in self.chunks(list(range(n))):
                shapes.add((self.bucket(len(chunk)), prefill_width, decode_width))
            shapes.add((0, None, decode_width))
        sampling = LaneSampling.of([SamplingParams()] * self.lanes)
        idle = np.zeros(self.lanes, np.int32)

        def table(rows, width):
            return np.zeros((rows, width), np.int32)

        for size, prefill_width, decode_width in sorted(shapes, key=str):
            decode = DecodeInputs(tokens=idle, fresh=np.ones(self.lanes, bool),
                                  previous=self._host_only, positions=idle,
                                  active=np.zeros(self.lanes, bool),
                                  table=table(self.lanes, decode_width))
            prefill = None
            if size:
                tokens = np.zeros((1, size), np.int32)
                prefill = PrefillInputs(tokens=tokens, positions=tokens, mask=tokens > 0,
                                        lane=np.int32(0), last=np.int32(0),
                                        table=table(1, prefill_width))
            prefill_host = decode_host = None
            if self._lane_inputs:
                decode_host = self._lane_inputs.rows(idle[:, None], idle, decode.active[:, None])
                if prefill is not None:
                    prefill_host = self._lane_inputs.rows(prefill.tokens, [0], prefill.mask,
                                                          lanes=[0])
            _, self.cache, self.residency.state = self._steps.step(
                self.params, self._replay_rows(size) if prefill is not None else None,
                self._replay_rows(self.lanes), prefill_host, decode_host, prefill, decode,
                self.cache, self.residency.state, sampling)
        log.info("compiled %d step shapes in %.1f s", len(shapes), time.perf_counter() - start)

    def set_routing_replay(self, picks: np.ndarray | None) -> None:
        """Route by recorded picks [N, L_moe, k] (expert ids of this model), consumed one row per
        token in order and cyclically, instead of by the router's own choice; None turns it off.
        Benchmarks use it to give random-weight models a trained model's routing."""
        if picks is not None and self.family.replay_variables is None:
            raise ValueError(f"the {self.family.name} family cannot replay recorded routing")
        if picks is not None:
            n_moe, n_experts = self.family.expert_dims(self.cfg)[:2]
            picks = np.asarray(picks, np.int32)
            if picks.ndim != 3 or picks.shape[1] != n_moe or picks.min() < 0 or picks.max() >= n_experts:
                raise ValueError(f"routing replay must be [N, {n_moe}, k] ids below {n_experts}, "
                                 f"got shape {picks.shape}")
            picks = parallel.replicated(picks)  # once: steps index it by a cursor
        self._replay, self._replay_cursor = picks, 0

    def _replay_rows(self, n_tokens: int):
        """(picks, cursor) for a step of `n_tokens` tokens (batch-major), which route by rows
        cursor, cursor + 1, ... of the picks, cyclically; None without a replay."""
        if self._replay is None:
            return None
        cursor = self._replay_cursor
        self._replay_cursor = (cursor + n_tokens) % len(self._replay)
        return self._replay, np.int32(cursor)

    # -- generation ------------------------------------------------------------------------

    def generate(self, prompts, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop: list[str] | tuple[str, ...] = (), on_text=None):
        """Generates for a prompt (str), a chat (list of message dicts), or a list of either;
        returns a str or a list of str to match. `on_text(i, text)` streams pieces as they come."""
        from tidejax.runtime.generate import generate
        return generate(self, prompts, max_new_tokens=max_new_tokens,
                        sampling=SamplingParams(temperature, top_p, top_k, seed), stop=tuple(stop),
                        on_text=on_text)

    def cache_bytes_per_token(self) -> int:
        return self.family.cache_bytes_per_token(self.cfg, self.dtype)

    def lane_bytes(self) -> int:
        """Cache bytes each decode lane keeps whatever its context (DeepSeek-V4.1's window rings
        and group buffers; 0 for a family that keeps everything in the pool)."""
        rows = jax.eval_shape(functools.partial(self.family.create_lane_cache, self.cfg, 1,
                                                self.max_context, self.dtype))
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(rows))

    def kv_stats(self) -> dict:
        """The KV cache's size: the pool's pages and bytes, what a dense cache of every lane at
        max_context would take, and the fixed rows the lanes keep beside the pool."""
        per_token = self.cache_bytes_per_token()
        return {"kv_pages": self.kv_pages, "page_size": self.page_size,
                "kv_tokens": self.kv_pages * self.page_size,
                "kv_bytes": int(self.kv_pages * self.page_size * per_token),
                "dense_kv_bytes": int(self.lanes * self.max_context * per_token),
                "lane_bytes": self.lane_bytes(), "lanes_bytes": self.lanes * self.lane_bytes()}


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
    chunk's last real token) scalars; table [1, P]."""

    tokens: jax.Array
    positions: jax.Array
    mask: jax.Array
    lane: jax.Array
    last: jax.Array
    table: jax.Array


@dataclasses.dataclass
class DecodeRows:
    """The scheduler's view of a step's decoding lanes (host values, [lanes] each); pages: each
    lane's KV pages, a lane's list covering its next position."""

    tokens: np.ndarray
    fresh: np.ndarray
    positions: np.ndarray
    active: np.ndarray
    pages: list[list[int]] | None = None


@dataclasses.dataclass
class PrefillChunk:
    """A prompt chunk for `lane`: tokens at positions start..; pages: the request's KV pages,
    covering the chunk."""

    lane: int
    tokens: list[int]
    start: int
    pages: list[int] | None = None


@dataclasses.dataclass
class _Steps:
    """The jitted functions over one model; the cache and the expert state are donated."""

    model: object
    replay_variables: object  # ids [b, t, L_moe, k] -> the "replay" collection; None: no replay

    def _forward(self, params, replay, inputs, tokens, positions, mask, cache, table, experts):
        variables = {"params": params}
        if replay is not None:
            picks, cursor = replay  # [N, L_moe, k], the row of the step's first token
            b, t = tokens.shape
            rows = (cursor + jnp.arange(b * t, dtype=jnp.int32)) % picks.shape[0]
            variables["replay"] = self.replay_variables(
                picks[rows].reshape(b, t, *picks.shape[1:]))  # [b, t, L_moe, k]
        extra = () if inputs is None else (inputs,)
        return self.model.apply(variables, tokens, positions, mask, cache, table, experts, *extra)

    def _prefill(self, params, replay, inputs, chunk: PrefillInputs, cache: PagedCache, experts):
        """The chunk's logits [1, C, vocab]: it writes the shared pool through its block table
        and its lane's slice of the per-lane rows."""
        lane = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, chunk.lane, 1, 0), cache.lanes)
        logits, out, experts = self._forward(params, replay, inputs, chunk.tokens, chunk.positions,
                                             chunk.mask, PagedCache(cache.pages, lane), chunk.table,
                                             experts)
        lanes = jax.tree.map(lambda a, u: jax.lax.dynamic_update_slice_in_dim(a, u, chunk.lane, 0),
                             cache.lanes, out.lanes)
        return logits, PagedCache(out.pages, lanes), experts

    @functools.cached_property
    def step(self):
        def step(params, replay_prefill, replay_decode, prefill_host, decode_host,
                 prefill: PrefillInputs | None, decode: DecodeInputs | None, cache, experts,
                 sampling: LaneSampling):
            out = jnp.zeros(sampling.seed.shape, jnp.int32)
            if prefill is not None:
                logits, cache, experts = self._prefill(params, replay_prefill, prefill_host,
                                                       prefill, cache, experts)
                lane_sampling = jax.tree.map(lambda a: a[prefill.lane][None], sampling)
                last = prefill.last
                first = sample(logits[:, last], lane_sampling, prefill.positions[:, last] + 1)
            if decode is not None:
                tokens = jnp.where(decode.fresh, decode.tokens, decode.previous)  # [lanes]
                logits, cache, experts = self._forward(
                    params, replay_decode, decode_host, tokens[:, None], decode.positions[:, None],
                    decode.active[:, None], cache, decode.table, experts)
                out = sample(logits[:, 0], sampling, decode.positions + 1)
            if prefill is not None:
                out = out.at[prefill.lane].set(first[0])
            return out, cache, experts
        return jax.jit(step, donate_argnames=("cache", "experts"))

    @functools.cached_property
    def score(self):
        def step(params, replay, inputs, tokens, positions, mask, cache, table, experts):
            logits, _, experts = self._forward(params, replay, inputs, tokens, positions, mask,
                                               cache, table, experts)
            return logits, experts
        return jax.jit(step, donate_argnames=("experts",))

    @functools.cached_property
    def read_sequence(self):
        def read(cache: PagedCache, pages, lane):
            return PagedCache(jax.tree.map(lambda leaf: leaf[pages], cache.pages),
                              jax.tree.map(lambda leaf: leaf[lane], cache.lanes))
        return jax.jit(read)

    @functools.cached_property
    def write_sequence(self):
        def write(cache: PagedCache, pages, lane, saved: PagedCache):
            def put(at):
                return lambda leaf, rows: leaf.at[at].set(rows.astype(leaf.dtype))
            return PagedCache(jax.tree.map(put(pages), cache.pages, saved.pages),
                              jax.tree.map(put(lane), cache.lanes, saved.lanes))
        return jax.jit(write, donate_argnames=("cache",))


def end_of_turn_ids(model_dir: Path, config_ids, tokenizer_eos: int | None) -> tuple[int, ...]:
    """Generation stops at config.json's eos ids, generation_config.json's (where published
    checkpoints list their end-of-turn tokens) and the tokenizer's eos token."""
    ids = set(config_ids) | ({tokenizer_eos} if tokenizer_eos is not None else set())
    generation = model_dir / "generation_config.json"
    if generation.exists():
        eos = read_json(generation).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return tuple(sorted(ids))


def load(model_or_profile: str | Path, trace_dir: str | None = None, **overrides) -> Engine:
    """Loads a checkpoint directory, a profile file (.toml) or a profile name (configs/NAME.toml).

    `overrides` are profile tables as dicts: load(dir, residency={"budget_experts": 24}).
    `trace_dir` writes a JAX profiler trace there until `Engine.close()` or exit.
    """
    if trace_dir:
        overrides.setdefault("engine", {})["trace_dir"] = str(trace_dir)
    target = Path(model_or_profile)
    if target.is_dir():
        config = EngineConfig.from_dict({"model": {"path": str(target)}}, source=str(target))
    else:
        config = EngineConfig.from_toml(resolve_profile(str(model_or_profile)))
    config = config.with_overrides(overrides)
    start = time.perf_counter()
    engine = Engine(config)
    log.info("loaded %s in %.1f s", engine.served_name, time.perf_counter() - start)
    return engine


def resolve_profile(name_or_path: str) -> Path:
    """A path to a .toml, or a name looked up in ./configs and in the repository's configs/."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        return path
    repo_configs = Path(__file__).resolve().parents[2] / "configs"
    for folder in (Path("configs"), repo_configs):
        if (folder / f"{name_or_path}.toml").exists():
            return folder / f"{name_or_path}.toml"
    raise ConfigError(f"profile {name_or_path!r} not found (looked for configs/{name_or_path}.toml "
                      f"and {repo_configs}/{name_or_path}.toml)")
