"""Loading: a checkpoint and its profile become a LoadedModel, the model the runner runs.

A LoadedModel holds what does not change while serving: the config, the family, the tokenizer,
the params on the device, the residency planner (runtime/state.py's DecodeState holds the expert
state itself), the jitted steps (runtime/steps.py) and the host-side shapes of their inputs. It
turns a StepPlan's host views of a step (DecodeRows, PrefillChunk) into the step's array
inputs. The cache is a kv.paged.PagedCache: the family's KV pool, shared by every sequence through
its block table, and the fixed-size rows each lane keeps (DeepSeek-V4.1's window rings), which a
prompt chunk reads and writes at its lane.

Step shapes are a bounded set known at start, all of which the warm-up compiles (warmup_shapes):
a prompt chunk is padded to one of a few bucket sizes, decode always runs all lanes, and each
block table is either max_context wide (max_pages: one shape) or, where the step's attention
reads every entry its table addresses, a power of two of the pages the rows need (the family's
table_widths says which, path by path). Sequence copies (preemption) go by powers of two of
pages (Steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tidejax import parallel
from tidejax.config import PATHS, EngineConfig, ResidencySection
from tidejax.errors import ConfigError
from tidejax.fields import read_json
from tidejax.kv.paged import PagedCache
from tidejax.kv.pages import page_bucket, pages_for
from tidejax.checkpoint import fp8
from tidejax.checkpoint.table import Deferred
from tidejax.models.layers.mtp import (MtpExpertRows, mtp_expert_row, mtp_params,
                                      with_mtp_slots)
from tidejax.models.loading import ExpertPool, RowFormat
from tidejax.models.registry import family_for
from tidejax.residency.manager import Residency
from tidejax.residency.disk import CheckpointRows, joined
from tidejax.residency.pool import host_pool, host_slots, pool_rows, row_bytes
from tidejax.residency.prepared import open_rows
from tidejax.residency.serve import ServeOptions
from tidejax.residency.swap import SwapBatch
from tidejax.runtime.compile_cache import compile_cache
from tidejax.runtime.executables import StepExecutables
from tidejax.runtime.state import DecodeState
from tidejax.runtime.speculative import Speculator
from tidejax.runtime.steps import (DecodeInputs, DecodeRows, Latest, PrefillChunk, PrefillInputs,
                                   Replay, ScoreInputs, StepInputs, Steps, VerifyInputs,
                                   replay_windows)
from tidejax.text.tokenizer import Tokenizer

log = logging.getLogger("tidejax")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _buckets(limit: int) -> list[int]:
    sizes, size = [], 16
    while size < limit:
        sizes.append(size)
        size *= 2
    return sizes + [limit]


# the profile's tables a step's program may depend on (not [server]), less the keys that never
# reach it (a change of these keeps the stored step executables); of the files and folders the
# profile names (config.PATHS) only whether one is set may reach it, never where it is
_PROGRAM_TABLES = ("model", "engine", "residency", "cache", "speculative", "distributed")
_OUTSIDE_PROGRAM = {"engine": ("compile_cache", "compile_workers", "warmup", "trace_dir")}


class LoadedModel:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir = Path(config.model.path)
        if not config.model.path or not (model_dir / "config.json").exists():
            raise ConfigError(f"{config.source_of('model.path')}: 'model.path' = "
                              f"{config.model.path!r} is not a checkpoint directory (no "
                              "config.json)")
        self.mesh = self._mesh(config)
        self.compile_cache = config.engine.compile_cache  # "": the process's setting
        if self.compile_cache:
            log.info("compiled steps cached in %s", self.compile_cache)
        with self.scope():
            self._load(config, model_dir)

    def compile_workers(self, shapes: int) -> int:
        """Threads to compile, or load from the kept executables, `shapes` warm-up step shapes
        on (engine.compile_workers)."""
        workers = self.config.engine.compile_workers
        if not workers:
            workers = 1 if jax.default_backend() == "cpu" else os.cpu_count() or 1
        return max(1, min(workers, shapes))

    def scope(self):
        """The model's own mesh and compilation cache, around its work: its loading here, every
        device call in the Runner (tidejax.parallel.on_mesh, runtime/compile_cache.py)."""
        return _scope(self.mesh, self.compile_cache)

    def _load(self, config: EngineConfig, model_dir: Path) -> None:
        raw = read_json(model_dir / "config.json")
        source = str(model_dir / "config.json")
        self.family = family_for(raw, source)
        self.cfg = self.family.config_from_hf(raw, source)
        check_speculative(config, self.family, self.cfg, source)
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
        alpha, up_shift = self.family.swiglu_form(self.cfg)
        serve = ServeOptions(
            miss_policy=config.residency.miss_policy, kernel=config.engine.kernel,
            moe_prefill=config.engine.moe_prefill, mhc_front=config.engine.mhc_front,
            scan_layers=config.engine.scan_layers,
            swiglu_limit=float(self.family.swiglu_limit(self.cfg)), swiglu_alpha=float(alpha),
            swiglu_up_shift=float(up_shift), count=config.residency.count)

        # the drafting MTP layer: one more MoE layer of the residency geometry, after the main's
        drafting = int(config.speculative.method == "mtp")
        self.params, self._aux, pool = load_weights(self.family, self.cfg, model_dir, raw, serve,
                                                    self.dtype, config.model.experts,
                                                    config.model.dense_format, self.mesh,
                                                    config.residency, drafting)
        if drafting:
            self._check_mtp_layer(config)
        on_disk = not isinstance(pool, dict)
        self.residency = Residency(
            None if on_disk else pool, self.family.expert_dims(self.cfg)[0] + drafting,
            self.family.top_k(self.cfg), config.residency, mtp_layers=drafting,
            kernel=config.engine.kernel, moe_prefill=serve.moe_prefill, mhc_front=serve.mhc_front,
            scan_layers=serve.scan_layers,
            swiglu_limit=serve.swiglu_limit,
            swiglu_form=(serve.swiglu_alpha, serve.swiglu_up_shift), max_tokens=self.max_context,
            disk_rows=pool if on_disk else None)
        if config.residency.trace_every_steps:  # a step routes a prompt chunk and the lanes
            self.residency.start_trace(self.served_name, raw.get("model_type", ""),
                                       self.max_context + config.engine.lanes)
        self.module = self.family.build(self.cfg, self.residency.options, self.dtype)
        self.speculator, self.step_params = self._speculation(config, fp8.config_block(raw))
        # the pool's layers: the MTP layers' slots after the decoder's where they draft
        self.cache_cfg = self.cfg if self.speculator is None else with_mtp_slots(self.cfg)
        self.page_size = config.engine.page_size
        self.kv_pages = self._pool_pages(config)
        self.max_pages = pages_for(self.max_context, self.page_size)
        self.full_prefill, self.full_decode = self.family.table_widths(
            self.cfg, self.page_size, self.dtype, self.residency.options)
        log.info("KV pool: %d pages of %d tokens (%.2f GiB), %d bytes a lane beside it",
                 self.kv_pages, self.page_size,
                 self.kv_pages * self.page_size * self.cache_bytes_per_token() / 2**30,
                 self.lane_bytes())
        self._prefill_buckets = _buckets(self.prefill_chunk)
        self.prefix_caching = self._prefix_caching(config)
        # whether a cached prefix needs its lane's rows restored (a snapshot)
        self.lane_snapshots = self.prefix_caching and self.lane_bytes() > 0
        self.steps = Steps(self.module, self.max_pages, self.speculator)
        self.executables = self._executables(config, model_dir)
        self._replay: jax.Array | None = None  # [N, L_moe, k] recorded picks on the device
        # requests admitted since set_routing_replay (next_replay_window): the next one's number
        self.replay_admitted = 0
        self.step_tables = self.family.step_tables(self.cfg, self._aux)  # every step's, as placed
        # the `previous` tokens of a step that takes every input from the host (committed to the
        # device, as a step's output is: one compilation)
        self.host_only = parallel.replicated(np.zeros(self.lanes, np.int32), self.mesh)
        self.host_latest = Latest(self.host_only, self.host_only)  # a verify step's likewise

    def _check_mtp_layer(self, config: EngineConfig) -> None:
        """[speculative] method "mtp" on a checkpoint whose config.json counts MTP layers that
        it lacks (seen at load) is refused, naming the field."""
        if self._aux is None:
            raise ConfigError(
                f"{config.source_of('speculative.method')}: 'speculative.method' = 'mtp' but "
                f"{self.model_dir} holds no MTP layer (config.json's field "
                f"'num_nextn_predict_layers' = {self.cfg.num_mtp_layers}, and no tensor "
                f"model.layers.{self.cfg.num_layers}.*)")

    def _executables(self, config: EngineConfig, model_dir: Path) -> StepExecutables | None:
        """The warm-up's step executables kept under engine.compile_cache, keyed by the model's
        config.json, its family config, serve options and dtype, and the profile but for the
        keys that never reach a step (runtime/executables.py); None without a cache folder or
        across processes."""
        if not self.compile_cache:
            return None
        if jax.process_count() > 1:
            log.info("step executables are not kept across processes: each start lowers them")
            return None
        profile = {name: dataclasses.asdict(getattr(config, name)) for name in _PROGRAM_TABLES}
        for table, key in PATHS:
            profile[table][key] = bool(profile[table][key])
        for table, keys in _OUTSIDE_PROGRAM.items():
            for key in keys:
                del profile[table][key]
        config_json = (model_dir / "config.json").read_bytes()
        return StepExecutables(self.compile_cache, {
            "family": self.family.name, "config.json": hashlib.sha256(config_json).hexdigest(),
            "config": repr(dataclasses.replace(self.cfg, source="")),  # not where it was read
            "serve": repr(self.residency.options),
            "dtype": str(self.dtype), "profile": repr(profile)}, list(self.mesh.devices.flat))

    def _speculation(self, config: EngineConfig, fp8_block) -> tuple:
        """(the Speculator, the steps' params: (params, the MTP layer's)) with [speculative]
        method "mtp"; (None, params) without. The MTP layer's FP8 weights are dequantized on the
        checkpoint's `fp8_block`; its routed experts are residency's last MoE layer
        (load_weights put them in the pool), served and counted as the main model's."""
        if config.speculative.method != "mtp":
            return None, self.params
        if config.residency.trace_every_steps:  # the verify round routes outside _forward
            raise ConfigError(f"{config.source_of('speculative.method')}: 'speculative.method' = "
                              "'mtp' does not record routing traces yet (set "
                              "residency.trace_every_steps = 0)")
        mtp = self.family.build_mtp(self.cfg, self.residency.options, self.dtype)
        draft = mtp_params(self.params, self._aux, self.cfg, self.dtype, fp8_block,
                           specs=self.family.mtp_specs(self.cfg, self.dtype))
        log.info("speculative decoding: the MTP layer drafts %d tokens a lane, verified in one "
                 "step of %d positions", config.speculative.tokens, config.speculative.tokens + 1)
        return Speculator(self.module, mtp, config.speculative.tokens), (self.params, draft)

    @property
    def speculating(self) -> int:
        """k, the tokens drafted a lane a step; 0 without speculative decoding."""
        return 0 if self.speculator is None else self.speculator.k

    @staticmethod
    def _mesh(config: EngineConfig):
        """The model's mesh, 1 x distributed.tensor_parallel (tidejax.parallel.tensor_mesh)."""
        try:
            mesh = parallel.tensor_mesh(config.distributed.tensor_parallel)
        except ValueError as e:
            raise ConfigError(f"{config.source_of('distributed.tensor_parallel')}: {e}") from None
        policy = config.residency.miss_policy
        if parallel.tensor_size(mesh) > 1 and policy in ("cpu", "auto"):
            raise ConfigError(f"{config.source_of('residency.miss_policy')}: "
                              f"'residency.miss_policy' = {policy!r} computes misses on the host "
                              "from the whole pool: not served on a mesh that splits 'tensor' "
                              f"{parallel.tensor_size(mesh)} ways "
                              "(distributed.tensor_parallel)")
        return mesh

    def initial_state(self) -> DecodeState:
        """The one DecodeState: a fresh KV cache, the residency boot state, greedy lanes."""
        return self._fresh_state(self.residency.take_state())

    def rebuilt_state(self, failed: DecodeState) -> DecodeState:
        """The DecodeState after a failed step: a fresh KV cache and greedy lanes, as at start,
        and the expert state residency rebuilds from `failed`'s expert rows (those no step
        donates) and its host map. What is left of `failed` but its rows is freed first (a step
        that failed before donating leaves it whole): the new pool and bank take its place."""
        rest = failed.replace(experts=failed.experts.without_rows())
        for leaf in jax.tree.leaves(rest):
            if not leaf.is_deleted():
                leaf.delete()
        return self._fresh_state(self.residency.rebuild(failed.experts.rows))

    def _fresh_state(self, experts) -> DecodeState:
        """A zeroed KV cache (committed to the device, as the steps return it: one compile per
        step, not two) and greedy lanes beside `experts`."""
        cache = self.new_cache(self.kv_pages, self.lanes)
        axes = self.family.cache_axes
        cache = PagedCache(
            parallel.put(cache.pages, axes(cache.pages), self.mesh) if axes
            else parallel.replicated(cache.pages, self.mesh),
            parallel.replicated(cache.lanes, self.mesh))
        return DecodeState.create(cache, experts, self.lanes, self.vocab_size, self.mesh,
                                  self.speculating)

    @property
    def vocab_size(self) -> int:
        """The logits' width: token ids a request may name are below it."""
        return self.cfg.vocab_size

    def new_cache(self, n_pages: int, lanes: int) -> PagedCache:
        """A zeroed cache: a pool of n_pages pages and the rows of `lanes` lanes."""
        return PagedCache(self.family.create_cache(self.cache_cfg, n_pages, self.page_size,
                                                   self.dtype),
                          self.family.create_lane_cache(self.cfg, lanes, self.max_context,
                                                        self.dtype))

    def _max_positions(self) -> int:
        return getattr(self.cfg, "max_position_embeddings", 1 << 30)

    def _pool_pages(self, config: EngineConfig) -> int:
        """Pages in the KV pool: engine.kv_pool_gib, else engine.kv_pool_tokens, else room for
        every lane at max_context. The pool must hold one sequence at max_context."""
        section, size = config.engine, self.page_size
        if size < 1:
            raise ConfigError(f"{config.source_of('engine.page_size')}: 'engine.page_size' must be "
                              "at least 1")
        multiple = self.family.page_multiple(self.cfg)
        if size % multiple:
            raise ConfigError(f"{config.source_of('engine.page_size')}: 'engine.page_size' = "
                              f"{size} must be a multiple of {multiple} for {self.family.name} (a "
                              "page holds whole groups of every compressed KV source)")
        if section.kv_pool_gib > 0 and self.cache_bytes_per_token() > 0:
            key = "engine.kv_pool_gib"
            pages = int(section.kv_pool_gib * 2**30 // (self.cache_bytes_per_token() * size))
        elif section.kv_pool_tokens > 0:
            key, pages = "engine.kv_pool_tokens", pages_for(section.kv_pool_tokens, size)
        else:
            key, pages = "engine.lanes", pages_for(self.lanes * self.max_context, size)
        if pages < pages_for(self.max_context, size):
            raise ConfigError(f"{config.source_of(key)}: '{key}' gives a KV pool of "
                              f"{pages * size} tokens, less than one sequence at "
                              f"engine.max_context ({self.max_context})")
        return pages

    def _prefix_caching(self, config: EngineConfig) -> bool:
        """Whether prompts share cached KV pages (cache.enabled). A family whose lanes keep rows
        beside the pool (DeepSeek-V4.1's and V4's window rings and compressor buffers, V4.1's
        Engram look-back) has them snapshotted where a prompt chunk ends a page
        (`lane_snapshots`): a match restores its last page's snapshot into the new lane."""
        if not config.cache.enabled:
            return False
        if self.lane_bytes():
            log.info("prompt cache for %s: its lanes' %d bytes of state beside the KV pool are "
                     "snapshotted to host memory where a prompt chunk ends a page",
                     self.family.name, self.lane_bytes())
        return True

    def snapshot_bytes(self) -> int:
        """Host bytes a lane snapshot holds: the lane's rows, its token counts ([vocab] int32
        and bool) and the one padded page a sequence copy of no pages reads (Steps)."""
        page = int(self.page_size * self.cache_bytes_per_token())
        return self.lane_bytes() + self.vocab_size * 5 + page

    # -- step inputs -----------------------------------------------------------------------

    def chunks(self, token_ids: list[int], begin: int = 0) -> list[tuple[int, list[int]]]:
        """(start, ids) of each prefill chunk of a prompt from `begin` (past a cached prefix):
        up to the cut (`_cut`) and past it, the remainder first (the run's length mod
        prefill_chunk, or a whole chunk), then whole chunks, so that where a chunk's table
        follows its end (_prefill_width) the first chunk's width is its bucket's and the whole
        chunks' are the few powers of two past one chunk."""
        n, out, start = len(token_ids), [], begin
        while start < n:
            length = self.chunk_length(start, n, begin)
            out.append((start, token_ids[start:start + length]))
            start += length
        return out

    def chunk_length(self, start: int, n: int, begin: int = 0) -> int:
        """Tokens in the chunk at `start` of an n-token prompt (chunks) whose prefill begins at
        `begin` (past a cached prefix)."""
        cut = self._cut(n, begin)
        first, end = (begin, cut) if start < cut else (cut, n)
        return self._first_chunk(end - first) if start == first else self.prefill_chunk

    def _cut(self, n: int, begin: int) -> int:
        """Where the chunks of an n-token prompt from `begin` also break: with lane snapshots,
        at its last page boundary before its last token, where a later turn that extends the
        prompt (or another choice of it) matches and so a snapshot must be (one is taken where
        a chunk ends a page); else n."""
        cut = (n - 1) // self.page_size * self.page_size
        return cut if self.lane_snapshots and cut > begin else n

    def _first_chunk(self, n: int) -> int:
        return n - self.prefill_chunk * ((n - 1) // self.prefill_chunk)

    def bucket(self, n: int) -> int:
        """The compiled prefill size that holds a chunk of n tokens."""
        return next(b for b in self._prefill_buckets if b >= n)

    def step_inputs(self, decode: DecodeRows | None, prefill: PrefillChunk | None,
                    previous: jax.Array | None, swaps: SwapBatch) -> StepInputs:
        """The jitted step's inputs (block tables, padded chunk, the family's step tables, replay
        rows, the swap batch). A decoding lane's input is previous[lane] (an earlier step's
        output, still on the device) or, where decode.fresh[lane], decode.tokens[lane] from the
        host. Speculating, every step is a verify step (verify_inputs)."""
        if self.speculator is not None:
            raise ValueError("a speculating model's steps are verify steps (verify_inputs)")
        if decode is None and prefill is None:
            raise ValueError("a step needs decoding lanes or a prompt chunk")
        previous = self._previous(decode, previous, self.host_only)
        prefill_in = self._chunk_inputs(prefill)
        decode_in = None
        if decode is not None:
            decode_in = DecodeInputs(
                tokens=decode.tokens.astype(np.int32), fresh=decode.fresh.astype(bool),
                previous=previous, positions=decode.positions.astype(np.int32),
                active=decode.active.astype(bool), table=self._decode_table(decode.pages))
        return StepInputs(prefill_in, decode_in, self.step_tables,
                          self._replay_rows(decode, prefill), swaps)

    def verify_inputs(self, decode: DecodeRows, prefill: PrefillChunk | None,
                      previous: Latest | None, swaps: SwapBatch) -> VerifyInputs:
        """A verify step's inputs: a decoding lane's latest token and position are previous's
        (the last verify step's Latest, on the device) or, where decode.fresh[lane], the host's;
        decode.pages cover each lane's positions up to the MTP chain's last
        (Scheduler.lookahead); the prompt chunk beside them as in step_inputs."""
        previous = self._previous(decode, previous, self.host_latest)
        return VerifyInputs(decode.tokens.astype(np.int32), decode.fresh.astype(bool),
                            decode.positions.astype(np.int32), previous,
                            decode.active.astype(bool), decode.drafted.astype(np.int32),
                            self._decode_table(decode.pages), self._chunk_inputs(prefill), swaps,
                            self._replay_rows(decode, prefill))

    @staticmethod
    def _previous(decode: DecodeRows | None, previous, host_only):
        """A step's `previous` inputs, or `host_only` where every input comes from the host."""
        if previous is not None:
            return previous
        if decode is not None and not decode.fresh.all():
            raise ValueError("a step without `previous` takes every input from the host")
        return host_only

    def _chunk_inputs(self, prefill: PrefillChunk | None) -> PrefillInputs | None:
        """A prompt chunk's inputs (padded to its bucket, its table), or None."""
        if prefill is None:
            return None
        if not 0 < len(prefill.tokens) <= self.prefill_chunk:
            raise ValueError(f"a prompt chunk holds 1..{self.prefill_chunk} tokens, "
                             f"got {len(prefill.tokens)}")
        return self._prefill_inputs(prefill, *self._chunk_shape(prefill.start,
                                                                 len(prefill.tokens)))

    def _decode_table(self, pages: list[list[int]]) -> np.ndarray:
        """The decoding lanes' block tables, as wide as the longest needs (_decode_width)."""
        return self._table(pages, self._decode_width(max((len(p) for p in pages), default=1)))

    def warmup_inputs(self, size: int, prefill_width: int | None, decode_width: int,
                      swaps: SwapBatch) -> StepInputs | VerifyInputs:
        """A step of one shape with every token masked out (nothing written, counted or sampled
        into a lane): a chunk bucket `size` (0: decode only) beside all lanes; speculating, the
        verify step of that shape."""
        idle = np.zeros(self.lanes, np.int32)
        table = np.zeros((self.lanes, decode_width), np.int32)
        prefill = None
        if size:
            tokens = np.zeros((1, size), np.int32)
            prefill = PrefillInputs(tokens=tokens, positions=tokens, mask=tokens > 0,
                                    lane=np.int32(0), last=np.int32(0),
                                    table=np.zeros((1, prefill_width), np.int32),
                                    rows=self._prompt_rows([], [], 0, size),
                                    following=np.int32(-1) if self.speculating else None)
        fresh, inactive = np.ones(self.lanes, bool), np.zeros(self.lanes, bool)
        if self.speculating:
            return VerifyInputs(idle, fresh, idle, self.host_latest, inactive, idle, table,
                                prefill, swaps, self._replay_rows(None, None))
        decode = DecodeInputs(tokens=idle, fresh=fresh, previous=self.host_only, positions=idle,
                              active=inactive, table=table)
        return StepInputs(prefill, decode, self.step_tables, self._replay_rows(None, None), swaps)

    def warmup_shapes(self, prompt_lengths: list[int] | None = None) -> set[tuple]:
        """(chunk bucket or 0, prefill table width or None, decode table width) of every step a
        request can meet up to max_context: each (bucket, width) some prompt's chunk meets beside
        each decode width the lanes can hold, and each decode width alone (every step carries all
        lanes, decoding or not). With `prompt_lengths`, only the steps of prompts of those lengths:
        their chunks, and the decode widths of no lane decoding (a prompt served alone: its
        lane holds no decode pages while it prefills) and at each prompt's end. With the prompt
        cache on, a prompt's chunks are those from each page boundary inside it too: a turn (or
        a later choice, n > 1) that it matches up to there prefills from it (chunks' `begin`),
        in chunks of other lengths."""
        if prompt_lengths:
            chunks = {self._chunk_shape(start, len(ids)) for n in prompt_lengths
                      for begin in range(0, n if self.prefix_caching else 1, self.page_size)
                      for start, ids in self.chunks(list(range(n)), begin)}
            decode = {self._decode_width(pages_for(min(n + 1, self.max_context), self.page_size))
                      for n in prompt_lengths} | {self._decode_width(0)}
        else:
            chunks = self._chunk_shapes()
            decode = {self._decode_width(n) for n in range(1, self.max_pages + 1)}
        return ({(size, width, d) for size, width in chunks for d in decode}
                | {(0, None, d) for d in decode})

    def _chunk_shapes(self) -> set[tuple[int, int]]:
        """(bucket, prefill table width) of every chunk of every prompt of 1..max_context - 1
        tokens (chunks): a first chunk of r = 1..prefill_chunk tokens ends at r, and the whole
        chunks after it end anywhere past prefill_chunk."""
        last, size = self.max_context - 1, self.prefill_chunk
        shapes = {self._chunk_shape(0, r) for r in range(1, min(size, last) + 1)}
        ends = range(pages_for(size + 1, self.page_size), pages_for(last, self.page_size) + 1)
        return shapes | {self._chunk_shape(pages * self.page_size - size, size)
                         for pages in (ends if last > size else ())}

    def sequence_sizes(self) -> list[int]:
        """The page counts a sequence copy (Steps.read_sequence / write_sequence) compiles for."""
        return sorted({page_bucket(n, self.max_pages) for n in range(1, self.max_pages + 1)})

    def score_inputs(self, token_ids, swaps: SwapBatch) -> tuple[ScoreInputs, int]:
        """(the scoring forward's inputs, the real length): the length padded to a power of two
        of at least 16 (few compiles for any length), over a scratch cache of its own (a pool
        of the sequence's pages in order, one lane's rows)."""
        ids = np.asarray(token_ids, np.int32).reshape(-1)
        n = len(ids)
        size = max(16, 1 << (n - 1).bit_length())
        tokens = np.zeros((1, size), np.int32)
        tokens[0, :n] = ids
        n_pages = pages_for(size, self.page_size)
        cache = self.new_cache(n_pages, 1)
        table = np.arange(n_pages, dtype=np.int32)[None]
        mask = (np.arange(size) < n)[None]
        return ScoreInputs(tokens, np.arange(size, dtype=np.int32)[None], mask, cache, table,
                           self.step_tables, self._replay_rows(None, None, rows=1), swaps), n

    def _decode_width(self, pages: int) -> int:
        """Block-table width of a step's decoding lanes, the longest holding `pages`
        (Family.table_widths)."""
        return self.max_pages if self.full_decode else page_bucket(pages, self.max_pages)

    def _prefill_width(self, end: int) -> int:
        """Block-table width of a prompt chunk ending at position `end` (Family.table_widths)."""
        return self.max_pages if self.full_prefill else page_bucket(
            pages_for(end, self.page_size), self.max_pages)

    def _table(self, pages: list[list[int]], width: int) -> np.ndarray:
        """Block tables [rows, width]: each row's pages, padded with page 0 (never read: past each
        row's length)."""
        table = np.zeros((len(pages), width), np.int32)
        for row, held in enumerate(pages):
            table[row, :len(held)] = held[:width]
        return table

    def _chunk_shape(self, start: int, n: int) -> tuple[int, int]:
        """(bucket, prefill table width) of a chunk of n tokens at `start`: the one place serving
        (_chunk_inputs) and the warm-up (warmup_shapes) take a chunk's shape from. Where the
        table's width follows the chunk's end, the bucket does too, so that a chunk after a cached
        prefix (any start) takes a shape a prompt's own chunks take: the bucket of its end while
        that is within one chunk, else a whole chunk (_chunk_shapes)."""
        size = self.bucket(n if self.full_prefill else min(start + n, self.prefill_chunk))
        return size, self._prefill_width(start + n)

    def _prefill_inputs(self, prefill: PrefillChunk, size: int, width: int):
        n = len(prefill.tokens)
        tokens = np.zeros((1, size), np.int32)
        tokens[0, :n] = prefill.tokens
        mask = (np.arange(size) < n)[None]
        return PrefillInputs(
            tokens=tokens, positions=np.arange(prefill.start, prefill.start + size, dtype=np.int32)[None],
            mask=mask, lane=np.int32(prefill.lane), last=np.int32(n - 1),
            table=self._table([prefill.pages], width),
            rows=self._prompt_rows(prefill.context, prefill.tokens, prefill.start, size),
            following=np.int32(prefill.following) if self.speculating else None)

    def _prompt_rows(self, context, tokens, start: int, size: int):
        """What the family reads on the host for a prompt chunk (Family.prompt_rows), or None."""
        if self.family.prompt_rows is None:
            return None
        return self.family.prompt_rows(self.cfg, self._aux, context, tokens, start, size)

    def set_prefill_chunk(self, tokens: int) -> None:
        """Prompt tokens a step carries from now on (benchmarks sweep it on one loaded model)."""
        if not 0 < tokens <= self.max_context:
            raise ValueError(f"prefill_chunk must be in 1..{self.max_context}, got {tokens}")
        self.prefill_chunk = tokens
        self._prefill_buckets = _buckets(tokens)

    def set_routing_replay(self, picks: np.ndarray | None) -> None:
        """Route by recorded picks [N, L_moe, k] (expert ids of this model) instead of by the
        router's own choice, keyed by the token: the token at position p of a request routes by
        row (its window + p) mod N (steps.Replay), the MTP layer's by that row's last main MoE
        layer's picks; None turns it off. Windows restart with each call: the a-th request
        admitted after it gets window a * stride mod N (next_replay_window, steps.replay_windows),
        the first window 0, so a new trace (or the same one again) starts from its first row; a
        request admitted before keeps its window. A prompt prefix served from the prompt cache
        keeps the KV computed under the window of the request that prefilled it (steps.Replay),
        so greedy output with the prompt cache on can differ from off. Benchmarks use it (with
        the prompt cache off) to give random-weight models a trained model's routing."""
        if picks is not None and not self.family.replays:
            raise ValueError(f"the {self.family.name} family cannot replay recorded routing")
        if picks is not None:
            n_moe, n_experts = self.family.expert_dims(self.cfg)[:2]
            picks = np.asarray(picks, np.int32)
            if picks.ndim != 3 or picks.shape[1] != n_moe or picks.min() < 0 or picks.max() >= n_experts:
                raise ValueError(f"routing replay must be [N, {n_moe}, k] ids below {n_experts}, "
                                 f"got shape {picks.shape}")
            picks = parallel.replicated(picks, self.mesh)  # once: steps index it by windows
        self._replay, self.replay_admitted = picks, 0

    def replay_windows(self, admissions) -> np.ndarray:
        """The windows of the requests admitted `admissions`-th since set_routing_replay (an int
        or an array; steps.replay_windows under this model's max_context); 0 without a replay."""
        if self._replay is None:
            return np.zeros_like(np.asarray(admissions, np.int64))
        return replay_windows(admissions, self.max_context, len(self._replay))

    def next_replay_window(self) -> int:
        """The window (RequestHandle.window) of a request admitted now: the next admission's
        replay_windows, counted from set_routing_replay; 0 without a replay."""
        window = int(self.replay_windows(self.replay_admitted))
        self.replay_admitted += 1
        return window

    def _replay_rows(self, decode: DecodeRows | None, prefill: PrefillChunk | None,
                     rows: int | None = None) -> Replay | None:
        """The replay of a step (each lane's window: decode.windows, the prompt chunk's lane
        prefill.window; 0 where not given) or of a forward of `rows` rows from window 0 (a
        scoring forward's); None without a replay."""
        if self._replay is None:
            return None
        windows = np.zeros(rows or self.lanes, np.int64)
        if decode is not None and decode.windows is not None:
            windows[:] = decode.windows
        if prefill is not None:
            windows[prefill.lane] = prefill.window
        return Replay(self._replay, (windows % len(self._replay)).astype(np.int32))

    def cache_bytes_per_token(self) -> int:
        """The pool's bytes a token adds (the MTP layers' slots included where they draft)."""
        return self.family.cache_bytes_per_token(self.cache_cfg, self.dtype)

    def lane_bytes(self) -> int:
        """Cache bytes each decode lane keeps whatever its context (DeepSeek-V4.1's window rings,
        group buffers and Engram look-back; 0 for a family that keeps everything in the pool)."""
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


def load_weights(family, cfg, model_dir: Path, raw: dict, serve: ServeOptions, dtype,
                 held_as: str, dense_format: str = "float", mesh=None,
                 residency: ResidencySection | None = None,
                 mtp_layers: int = 0) -> tuple[dict, object, object]:
    """(dense params on the device, the family's aux, the routed experts' pool in host memory):
    the pool is placed first and filled in place as the rows are read, so it is never held twice
    (models.loading.ExpertPool with residency.pool.host_pool). dense_format "fp8" (only for a
    family with Family.dense_fp8): the projections stored FP8 stay FP8 on the device. mesh: the
    model's (None: parallel.current_mesh); named to the pool, which the reading threads place.
    Where `residency.host_budget_experts` (or host_budget_gib, of rows as served) holds fewer
    than every expert, no row is read here: the third item is then the rows on disk
    (residency.prepared.open_rows; across processes this process's shards of them), which the
    host cache reads from as needed.
    mtp_layers (0 or 1, speculating): the pool has one more MoE layer after the main model's,
    the first MTP layer's routed experts (put_mtp_rows), where the checkpoint holds it; on disk,
    its rows follow the main model's (residency.disk.joined), read from the loader's kept
    tensors (MtpExpertRows) in place or from a prepared copy of their own."""
    mesh = mesh or parallel.current_mesh()
    n_moe, n_experts = family.expert_dims(cfg)[:2]
    n_moe += mtp_layers
    fmt = {}
    if dense_format != "float":
        if not family.dense_fp8:
            raise ConfigError(f"model.dense_format = {dense_format!r}: the {family.name} family "
                              f"keeps its dense weights float (use 'float')")
        fmt = {"dense_format": dense_format}
    pool = ExpertPool(n_moe * n_experts, held_as, dtype,
                      place=functools.partial(host_pool, mesh=mesh))
    put_row = pool_rows(pool.put_row, parallel.tensor_size(mesh))
    if residency is None or not (residency.host_budget_experts or residency.host_budget_gib):
        params, aux = family.load_weights(cfg, model_dir, raw, serve, dtype, put_row, **fmt)
        put_mtp_rows(cfg, aux if mtp_layers else None, put_row, dtype, raw)
        return params, aux, pool.result()
    deferred = Deferred()  # a host budget: how many rows it holds is known from the headers
    params, aux = family.load_weights(cfg, model_dir, raw, serve, dtype, deferred, **fmt)
    rows = CheckpointRows(deferred.source, RowFormat(held_as, dtype))
    if host_slots(residency, row_bytes(rows.layout), n_moe * n_experts) == n_moe * n_experts:
        deferred.source.read_all(put_row)  # the budget holds every expert: the host pool
        put_mtp_rows(cfg, aux if mtp_layers else None, put_row, dtype, raw)
        return params, aux, pool.result()
    main = open_rows(rows, residency.state_dir, mesh=mesh)
    if not (mtp_layers and aux):  # without the MTP layer's tensors: refused after the load
        return params, aux, main
    mtp = CheckpointRows(MtpExpertRows(aux, cfg, dtype, fp8.config_block(raw)),
                         RowFormat(held_as, dtype).joining(main.layout))
    return params, aux, joined(main, open_rows(mtp, residency.state_dir, label="-mtp",
                                             mesh=mesh))


def put_mtp_rows(cfg, kept: dict | None, put_row, dtype, raw: dict) -> None:
    """The first MTP layer's routed experts (as the loader kept them: `kept`, the family's aux;
    None: nothing to put) into the pool as MoE layer len(cfg.moe_layers) of the residency
    geometry, one row at a time (FP8 ones dequantized on the checkpoint's block)."""
    if kept is None:
        return
    first = len(cfg.moe_layers) * cfg.n_routed_experts
    for e in range(cfg.n_routed_experts):
        put_row(first + e, mtp_expert_row(kept, cfg, e, dtype, fp8.config_block(raw)))


def check_speculative(config: EngineConfig, family, cfg, source: str) -> None:
    """[speculative] method "mtp" needs a family that drafts with its MTP layers, a checkpoint
    that has one (config.json's num_nextn_predict_layers); LoadedModel._check_mtp_layer refuses
    a count whose tensors the checkpoint lacks (seen at load)."""
    if config.speculative.method != "mtp":
        return
    given = config.source_of("speculative.method")
    if family.build_mtp is None:
        raise ConfigError(f"{given}: 'speculative.method' = 'mtp': the {family.name} family has "
                          "no MTP draft forward")
    if not getattr(cfg, "num_mtp_layers", 0):
        raise ConfigError(f"{given}: 'speculative.method' = 'mtp' but {source} has no MTP layer "
                          "(field 'num_nextn_predict_layers' is 0 or absent)")


@contextlib.contextmanager
def _scope(mesh, cache_folder: str):
    with parallel.on_mesh(mesh), compile_cache(cache_folder):
        yield


def end_of_turn_ids(model_dir: Path, config_ids, tokenizer_eos: int | None) -> tuple[int, ...]:
    """Generation stops at config.json's eos ids, generation_config.json's (where published
    checkpoints list their end-of-turn tokens) and the tokenizer's eos token."""
    ids = set(config_ids) | ({tokenizer_eos} if tokenizer_eos is not None else set())
    generation = model_dir / "generation_config.json"
    if generation.exists():
        eos = read_json(generation).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return tuple(sorted(ids))


