"""The public Engine: a facade over the loaded model, its runner and its scheduler.

`tidejax.load` builds a LoadedModel (runtime/build.py: config, tokenizer, params, residency
planner, jitted steps), the Runner that holds the one DecodeState (KV cache: a
kv.paged.PagedCache of the shared page pool and the lanes' fixed rows; expert state; lane
sampling) and is the only caller of the steps (runtime/runner.py), and the Scheduler that plans
for it (runtime/scheduler.py). The Engine keeps the public surface: `generate`, `logits`,
`residency`, `kv_stats`, `warmup`; every call that touches the device goes through the scheduler
(on its thread while it serves).
"""

from __future__ import annotations

import atexit
import logging
import time
from pathlib import Path

import jax
import numpy as np

from tidejax.config import EngineConfig
from tidejax.errors import ConfigError
from tidejax.runtime.build import LoadedModel
from tidejax.runtime.runner import Runner
from tidejax.runtime.sampling import SamplingParams
from tidejax.runtime.scheduler import Scheduler
from tidejax.runtime.steps import DecodeRows, PrefillChunk

log = logging.getLogger("tidejax")

CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. Der schnelle braune Fuchs springt. "
    "Le renard brun saute par-dessus le chien. def main(argv):\n    return 0\n"
    "for f in *.txt; do echo \"$f\"; done\nNAME\n    ls - list directory contents\n")


class Engine:
    """Load with `tidejax.load(...)`. The scheduler's thread drives the steps while a server runs;
    `generate` runs the scheduler on the caller's thread when none does, and `logits` runs on
    the scheduler thread when it serves (between two steps), on the caller's otherwise."""

    def __init__(self, config: EngineConfig, channel=None):
        """channel: process 0's channel to its peers (tidejax.distributed.start), None alone."""
        self.config = config
        self.loaded = LoadedModel(config)
        self.runner = Runner(self.loaded, channel)
        self.scheduler = Scheduler(self.loaded, self.runner)
        if channel is not None:  # a peer that is gone stops the serving, saying why
            channel.watch(config.distributed.heartbeat_s / 5, self.scheduler.peer_lost)
        self._closed = False
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
        """Where residency.state_dir is set, drains the demand counted since the last drain into
        the history and saves it and the residency stats; the prompt cache's host tier goes to
        its disk tier (where it has one: Scheduler.close_tiers); then finishes the profiler trace, if
        one is being written; last, the peers of process 0 stop. The server closes its engine at
        shutdown (SIGTERM, SIGINT)."""
        if self._closed:
            return
        self._closed = True
        state_dir = self.residency.state_dir
        if state_dir:
            try:
                self.scheduler.call(lambda: self.runner.update_experts(self.residency.drain))
            except Exception:
                log.exception("could not drain the demand counters at close")
            else:
                if not self.residency.save_failing:
                    log.info("saved the demand history and the residency stats under %s",
                             state_dir)
        try:
            self.scheduler.call(self.residency.close_trace)
        except Exception:
            log.exception("could not write the routing trace's last records at close")
        try:
            self.scheduler.call(self.scheduler.close_tiers)
        except Exception:
            log.exception("could not write the prompt cache's host tier to disk at close")
        if self.trace_dir:
            jax.profiler.stop_trace()
            self.trace_dir = ""
        self.runner.stop_peers()

    def _calibrate(self) -> None:
        """No seed map and no history: seat the experts a short mixed prompt wants most."""
        ids = self.tokenizer.encode(CALIBRATION_TEXT)[: self.loaded.prefill_chunk]
        self.logits(ids)
        self.runner.update_experts(self.residency.reseed)

    # -- what the model is -----------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def cfg(self):
        return self.loaded.cfg

    @property
    def family(self):
        return self.loaded.family

    @property
    def served_name(self) -> str:
        return self.loaded.served_name

    @property
    def lanes(self) -> int:
        return self.loaded.lanes

    @property
    def max_context(self) -> int:
        return self.loaded.max_context

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.loaded.eos_ids

    @property
    def residency(self):
        """Stats, freeze(), unfreeze(), save(): the residency planner (its state is in the
        runner's DecodeState)."""
        return self.loaded.residency

    @property
    def state(self):
        """The runner's DecodeState as the last step left it (tests and tools, between steps:
        a running step has it donated)."""
        return self.runner.state

    # -- the device, through the scheduler -------------------------------------------------

    def step(self, decode: DecodeRows | None, prefill: PrefillChunk | None,
             previous: jax.Array | None = None) -> jax.Array:
        """One step planned by the scheduler (Scheduler.run_step); tokens [lanes] on the device.
        `previous`: the tokens the last call returned, which the lanes not `fresh` take."""
        step = None
        if previous is not None:
            last = self.runner.last
            if last is None or previous is not last[1]:
                raise ValueError("a step's previous tokens must be the last step's output")
            step = last[0]
        return self.scheduler.run_step(decode, prefill, step).sampled.tokens

    def read_sequence(self, pages: list[int], lane: int):
        """A sequence's pages of the pool, its lane's rows and token counts, in host memory
        (what preemption saves: Scheduler.read_sequence)."""
        return self.scheduler.call(lambda: self.scheduler.read_sequence(pages, lane))

    def write_sequence(self, pages: list[int], lane: int, saved) -> None:
        """Puts what `read_sequence` read back at `pages` and `lane` (Scheduler.write_sequence)."""
        self.scheduler.call(lambda: self.scheduler.write_sequence(pages, lane, saved))

    def logits(self, token_ids) -> np.ndarray:
        """A full forward over `token_ids` (a fresh cache): logits [T, vocab] float32."""
        return self.scheduler.call(lambda: self.scheduler.score(token_ids))

    def warmup(self, prompt_lengths: list[int] | None = None) -> None:
        """Compiles every step shape a request can meet up to max_context (with
        `prompt_lengths`, the steps prompts of these lengths meet), the sequence copies of
        preemption and the lanes' sampling update, before traffic arrives, by running the steps
        with every token masked out: nothing is written, counted or sampled into a lane."""
        start = time.perf_counter()
        n = self.scheduler.call(lambda: self.scheduler.warmup(prompt_lengths))
        log.info("compiled %d step shapes and %d sequence copies in %.1f s", n,
                 len(self.loaded.sequence_sizes()), time.perf_counter() - start)

    def set_routing_replay(self, picks: np.ndarray | None) -> None:
        """Route by recorded picks [N, L_moe, k] (benchmarks; see LoadedModel.set_routing_replay)."""
        self.scheduler.call(lambda: self.runner.set_routing_replay(picks))

    def set_prefill_chunk(self, tokens: int) -> None:
        """Prompt tokens a step carries from now on (benchmarks sweep it on one loaded model)."""
        self.scheduler.call(lambda: self.loaded.set_prefill_chunk(tokens))

    # -- generation ------------------------------------------------------------------------

    def generate(self, prompts, max_new_tokens: int = 128,
                 stop: list[str] | tuple[str, ...] = (), on_text=None, **sampling):
        """Generates for a prompt (str), a chat (list of message dicts), or a list of either;
        returns a str or a list of str to match. `on_text(i, text)` streams pieces as they come.
        `sampling`: the fields of one SamplingParams (temperature, top_p, top_k, seed, min_p,
        presence_penalty, frequency_penalty, repetition_penalty, logit_bias {id: bias}), for
        every prompt; logprobs are the server's (this returns text)."""
        from tidejax.runtime.generate import generate
        return generate(self, prompts, max_new_tokens=max_new_tokens,
                        sampling=SamplingParams(**sampling), stop=tuple(stop), on_text=on_text)

    def cache_bytes_per_token(self) -> int:
        return self.loaded.cache_bytes_per_token()

    def lane_bytes(self) -> int:
        """Cache bytes each decode lane keeps beside the pool (LoadedModel.lane_bytes)."""
        return self.loaded.lane_bytes()

    def kv_stats(self) -> dict:
        """The KV cache's size: the pool's pages and bytes, a dense cache's, the lanes' rows."""
        return self.loaded.kv_stats()


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
    if "/" in name_or_path or name_or_path.startswith("."):  # a path, not a profile's name
        raise ConfigError(f"{name_or_path}: no such checkpoint directory or profile file")
    raise ConfigError(f"profile {name_or_path!r} not found (looked for configs/{name_or_path}.toml "
                      f"and {repo_configs}/{name_or_path}.toml)")
