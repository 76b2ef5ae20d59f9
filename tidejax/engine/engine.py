"""The engine: a loaded model, its caches and expert state, and the jitted steps over them.

Shapes are static: prefill runs in chunks padded to a few bucket sizes, decode always runs all
lanes, so each (phase, bucket) compiles once. The generation cache and the expert state are
donated into every step and come back updated in place. A decode step returns its tokens on the
device without waiting for them, and takes each lane's input from the previous step's output
there, so the scheduler can queue the next step before it reads this one's tokens.
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

from tidejax.config import EngineConfig
from tidejax.fields import ConfigError, read_json
from tidejax.engine.sampling import LaneSampling, SamplingParams, sample
from tidejax.engine.tokenizer import Tokenizer
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
        self.max_context = min(config.engine.max_context, self._max_positions())
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
        # committed to the device, as the steps return it: one compile per step, not two
        self.cache = jax.device_put(
            self.family.create_cache(self.cfg, self.lanes, self.max_context, self.dtype),
            jax.devices()[0])
        self._prefill_buckets = _buckets(self.prefill_chunk)
        replay = self.family.replay_variables
        self._steps = _Steps(self.model, functools.partial(replay, self.cfg) if replay else None)
        self._replay: jax.Array | None = None  # [N, L_moe, k] recorded picks on the device
        self._replay_cursor = 0  # the row the next token routes by
        self._lane_inputs = self.family.host_inputs(self.cfg, self._aux, self.lanes)
        # the `previous` tokens of a decode step that takes every input from the host (committed
        # to the device, as a step's output is: one compilation)
        self._host_only = jax.device_put(np.zeros(self.lanes, np.int32), jax.devices()[0])
        from tidejax.engine.scheduler import Scheduler  # circular at import time only
        self.scheduler = Scheduler(self)
        if self.residency.needs_calibration:
            self._calibrate()
        self.trace_dir = config.engine.trace_dir
        if self.trace_dir:
            jax.profiler.start_trace(self.trace_dir)
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

    def _calibrate(self) -> None:
        """No seed map and no history: seat the experts a short mixed prompt wants most."""
        ids = self.tokenizer.encode(CALIBRATION_TEXT)[: self.prefill_chunk]
        self.logits(ids)
        self.residency.reseed()

    # -- steps -----------------------------------------------------------------------------

    def prefill(self, lane: int, token_ids: list[int], sampling: SamplingParams) -> int:
        """Writes `token_ids` (positions 0..n-1) into `lane`'s cache, returns the sampled next token."""
        n = len(token_ids)
        if not 0 < n < self.max_context:
            raise ValueError(f"prompt of {n} tokens does not fit the context of {self.max_context}")
        lane_sampling = LaneSampling.of([sampling])
        with jax.profiler.TraceAnnotation("prefill"):
            token = self._prefill_chunks(lane, token_ids, lane_sampling)
        self.residency.after_step(n)
        token = int(token)
        self.residency.flush()  # the prefill is done: its tallies are ready
        return token

    def _chunks(self, token_ids: list[int]) -> list[tuple[int, list[int]]]:
        """(start, ids) of each prefill chunk of a prompt."""
        return [(start, token_ids[start:start + self.prefill_chunk])
                for start in range(0, len(token_ids), self.prefill_chunk)]

    def _bucket(self, n: int) -> int:
        """The compiled prefill size that holds a chunk of n tokens."""
        return next(b for b in self._prefill_buckets if b >= n)

    def _prefill_chunks(self, lane: int, token_ids: list[int], lane_sampling: LaneSampling):
        for start, chunk in self._chunks(token_ids):
            size = self._bucket(len(chunk))
            tokens = np.zeros((1, size), np.int32)
            tokens[0, :len(chunk)] = chunk
            positions = np.arange(start, start + size, dtype=np.int32)[None]
            mask = (np.arange(size) < len(chunk))[None]
            inputs = (self._lane_inputs.rows(tokens, [start], mask, lanes=[lane])
                      if self._lane_inputs else None)
            token, self.cache, experts = self._steps.prefill(
                self.params, self._replay_rows(tokens.size), inputs, tokens, positions, mask,
                np.int32(lane), self.cache, self.residency.state, np.int32(len(chunk) - 1),
                lane_sampling)
            self.residency.state = experts
        return token

    @property
    def pipelined(self) -> bool:
        """Whether a decode step can take its input tokens from the previous step's output on the
        device. Not where the family computes host inputs from the token ids (DeepSeek-V4.1's
        Engram hashes): then every token must be on the host before its step."""
        return self._lane_inputs is None

    def decode(self, tokens: np.ndarray, positions: np.ndarray, active: np.ndarray,
               sampling: LaneSampling, previous: jax.Array | None = None,
               fresh: np.ndarray | None = None) -> jax.Array:
        """Queues one step for all lanes and returns its next tokens [lanes] on the device, not
        waiting for them. positions / active [lanes]. Each lane's input token is previous[lane]
        (an earlier step's output, still on the device) or, where fresh[lane], tokens[lane]
        from the host; previous None: every input from `tokens`."""
        if previous is None:
            previous, fresh = self._host_only, np.ones(self.lanes, bool)
        elif not self.pipelined:
            raise ValueError(f"the {self.family.name} family needs every input token on the host")
        elif fresh is None:
            raise ValueError("decode(previous=...) needs fresh: which lanes take the host token")
        inputs = (self._lane_inputs.rows(tokens[:, None], positions, active[:, None])
                  if self._lane_inputs else None)
        with jax.profiler.TraceAnnotation("decode"):
            next_tokens, self.cache, self.residency.state = self._steps.decode(
                self.params, self._replay_rows(self.lanes), inputs, tokens.astype(np.int32),
                fresh, previous, positions.astype(np.int32), active, self.cache,
                self.residency.state, sampling)
        self.residency.after_step(int(active.sum()))
        return next_tokens

    def logits(self, token_ids) -> np.ndarray:
        """A full forward over `token_ids` (a fresh cache): logits [T, vocab] float32."""
        ids = np.asarray(token_ids, np.int32).reshape(-1)
        n = len(ids)
        size = max(16, 1 << (n - 1).bit_length())  # powers of two: few compiles for any length
        tokens = np.zeros((1, size), np.int32)
        tokens[0, :n] = ids
        cache = self.family.create_cache(self.cfg, 1, size, self.dtype)
        mask = (np.arange(size) < n)[None]
        scoring_inputs = self.family.host_inputs(self.cfg, self._aux, 1)
        inputs = scoring_inputs.rows(tokens, [0], mask) if scoring_inputs else None
        logits, experts = self._steps.score(
            self.params, self._replay_rows(tokens.size), inputs, tokens,
            np.arange(size, dtype=np.int32)[None], mask, cache, self.residency.state)
        self.residency.state = experts
        self.residency.after_step(n)
        logits = np.asarray(logits[0, :n], np.float32)
        self.residency.flush()
        return logits

    def warmup(self, prompt_lengths: list[int] | None = None) -> None:
        """Compiles the decode step and the prefill chunk sizes (those `prompt_lengths` need, or
        all) before traffic arrives, by running them with every token masked out: nothing is
        counted and no lane is used."""
        start = time.perf_counter()
        lanes = np.zeros(self.lanes, np.int32)
        self.decode(lanes, lanes, np.zeros(self.lanes, bool),
                    LaneSampling.of([SamplingParams()] * self.lanes))
        sizes = self._prefill_buckets
        if prompt_lengths is not None:
            sizes = sorted({self._bucket(len(chunk)) for n in prompt_lengths
                            for _, chunk in self._chunks(list(range(n)))})
        for size in sizes:
            tokens = np.zeros((1, size), np.int32)
            inputs = (self._lane_inputs.rows(tokens, [0], tokens > 0, lanes=[0])
                      if self._lane_inputs else None)
            _, self.cache, self.residency.state = self._steps.prefill(
                self.params, self._replay_rows(tokens.size), inputs, tokens, tokens, tokens > 0,
                np.int32(0), self.cache, self.residency.state, np.int32(0),
                LaneSampling.of([SamplingParams()]))
        log.info("compiled the steps in %.1f s", time.perf_counter() - start)

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
            picks = jax.device_put(picks, jax.devices()[0])  # once: steps index it by a cursor
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
        from tidejax.engine.generate import generate
        return generate(self, prompts, max_new_tokens=max_new_tokens,
                        sampling=SamplingParams(temperature, top_p, top_k, seed), stop=tuple(stop),
                        on_text=on_text)

    def cache_bytes_per_token(self) -> int:
        return self.family.cache_bytes_per_token(self.cfg, self.dtype)


@dataclasses.dataclass
class _Steps:
    """The jitted functions over one model; cache and expert state are donated."""

    model: object
    replay_variables: object  # ids [b, t, L_moe, k] -> the "replay" collection; None: no replay

    def _forward(self, params, replay, inputs, tokens, positions, mask, cache, experts):
        variables = {"params": params}
        if replay is not None:
            picks, cursor = replay  # [N, L_moe, k], the row of the step's first token
            b, t = tokens.shape
            rows = (cursor + jnp.arange(b * t, dtype=jnp.int32)) % picks.shape[0]
            variables["replay"] = self.replay_variables(
                picks[rows].reshape(b, t, *picks.shape[1:]))  # [b, t, L_moe, k]
        extra = () if inputs is None else (inputs,)
        return self.model.apply(variables, tokens, positions, mask, cache, experts, *extra)

    @functools.cached_property
    def prefill(self):
        def step(params, replay, inputs, tokens, positions, mask, lane, cache, experts, last,
                 sampling):
            lane_cache = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, lane, 1, 0), cache)
            logits, lane_cache, experts = self._forward(params, replay, inputs, tokens, positions,
                                                        mask, lane_cache, experts)
            cache = jax.tree.map(lambda a, u: jax.lax.dynamic_update_slice_in_dim(a, u, lane, 0),
                                 cache, lane_cache)
            token = sample(logits[:, last], sampling, positions[:, last] + 1)
            return token[0], cache, experts
        return jax.jit(step, donate_argnames=("cache", "experts"))

    @functools.cached_property
    def decode(self):
        def step(params, replay, inputs, tokens, fresh, previous, positions, active, cache,
                 experts, sampling):
            tokens = jnp.where(fresh, tokens, previous)  # [lanes]
            logits, cache, experts = self._forward(params, replay, inputs, tokens[:, None],
                                                   positions[:, None], active[:, None], cache, experts)
            return sample(logits[:, 0], sampling, positions + 1), cache, experts
        return jax.jit(step, donate_argnames=("cache", "experts"))

    @functools.cached_property
    def score(self):
        def step(params, replay, inputs, tokens, positions, mask, cache, experts):
            logits, _, experts = self._forward(params, replay, inputs, tokens, positions, mask,
                                               cache, experts)
            return logits, experts
        return jax.jit(step, donate_argnames=("experts",))


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
