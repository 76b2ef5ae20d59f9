"""Host overhead of the decode loop: ms a step through the scheduler, as `generate` and the server
run it, beside ms a step of the same jitted decode step queued back to back with nothing read
back (the device's own pace).

    python -m bench.step_overhead MODEL_DIR [--steps 64] [--lanes 1,4] [--resident 1.0,0.65]
        [--trace en] [--set table.key=value ...]

Each resident share is a fresh `tidejax.load` with engine.lanes = the most --lanes (a step
always runs every lane; the others sit idle), engine.max_context = 1024 (unless --set gives
them) and, below 1, residency.budget_experts set and a seed map fitted on the replayed trace, as
bench/roofline.py does. Per (share, lanes) it prints

    loop   ms a decode step in Scheduler.step: admit, queue the step, read the previous step's
           tokens, emit them, the residency's per-step work (steps counted: decode steps queued)
    engine ms a step of Engine.step called back to back, tokens never read: the step and the
           residency's per-step work, without the scheduler
    bare   ms a step of the jitted decode step alone, back to back, nothing read
    ratio  loop / bare: 1.0 = the device never waits for the host

Requests sample at temperature 0.6 (as
roofline.py drives them) and ignore end-of-sequence.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np


from bench.roofline import load_config, parse_set, prompt_ids, raise_errors
from tidejax.runtime.plan import StepPlan
from tidejax.runtime.sampling import SamplingParams
from tidejax.runtime.steps import DecodeRows
from tidejax.runtime.scheduler import GenerationRequest
from tidejax.kv.pages import pages_for

PROMPT_TOKENS = 16
SAMPLING = SamplingParams(temperature=0.6, seed=0)


def loop_ms(engine, lanes: int, steps: int) -> float:
    """ms per decode step of `lanes` requests of steps + 1 tokens through the scheduler, timed
    from the first decode step's queueing to the end: that step and all after it."""
    for i in range(lanes):
        engine.scheduler.submit(GenerationRequest(
            prompt_ids(engine, "en", PROMPT_TOKENS, offset=997 * i), steps + 1,
            dataclasses.replace(SAMPLING, seed=i), ignore_eos=True), raise_errors)
    generated = engine.scheduler.totals["generated_tokens"]
    while engine.scheduler.totals["generated_tokens"] < generated + lanes:
        engine.scheduler.step()  # the prompts, one a step, until each request has its first token
    first = engine.scheduler.totals["steps"]  # counts the step just queued
    start = time.perf_counter()
    engine.scheduler.run_until_idle()
    return (time.perf_counter() - start) * 1e3 / (engine.scheduler.totals["steps"] - first + 1)


def _decode_rows(engine, lanes: int, fresh: bool) -> DecodeRows:
    """A step of `lanes` active lanes at position PROMPT_TOKENS, each holding the pages of lane 0's
    first pages (what they read, not what they hold, is what a step costs)."""
    active = np.arange(engine.lanes) < lanes
    positions = np.where(active, PROMPT_TOKENS, 0).astype(np.int32)
    pages = [list(range(pages_for(PROMPT_TOKENS + 1, engine.loaded.page_size)))] * engine.lanes
    return DecodeRows(np.zeros(engine.lanes, np.int32), np.full(engine.lanes, fresh), positions,
                      active, pages)


def _step_windows(engine, step: int) -> np.ndarray:
    """[lanes] each lane's replay window (DecodeRows.windows) for bare step `step`, as the
    scheduler routes a served lane: lane i's window is that of the i-th request admitted since
    the replay was set (LoadedModel.replay_windows), moved on by `step` since a bare step
    repeats position PROMPT_TOKENS, so its token routes by row (window + PROMPT_TOKENS + step)
    mod N, the row of a served lane's token at that position (a served lane's admission also
    counts the requests before its batch: a shift of every window mod N), so bare and served
    steps differ in their host work only."""
    return engine.loaded.replay_windows(np.arange(engine.lanes)) + step


def _first_step(engine, lanes: int):
    """Every lane sampling as SAMPLING, and a first step's output (waited for)."""
    engine.runner.run(StepPlan(lanes={lane: SAMPLING for lane in range(engine.lanes)}))
    return jax.block_until_ready(engine.step(_decode_rows(engine, lanes, True), None))


def engine_ms(engine, lanes: int, steps: int) -> float:
    """ms per step of Engine.step back to back, each fed the previous one's tokens on the
    device, none read."""
    out = _first_step(engine, lanes)
    decode = _decode_rows(engine, lanes, False)
    start = time.perf_counter()
    for step in range(steps):
        decode.windows = _step_windows(engine, step)
        out = engine.step(decode, None, previous=out)
    jax.block_until_ready(out)
    engine.residency.flush()
    return (time.perf_counter() - start) * 1e3 / steps


def bare_ms(engine, lanes: int, steps: int) -> float:
    """ms per step of the jitted step alone (Runner.dispatch, the call Engine.step queues,
    with a swap batch that changes nothing), back to back, none read."""
    out = _first_step(engine, lanes)
    decode = _decode_rows(engine, lanes, False)
    idle = engine.residency.idle_batch()
    start = time.perf_counter()
    for step in range(steps):
        decode.windows = _step_windows(engine, step)
        sampled, _ = engine.runner.dispatch(engine.loaded.step_inputs(decode, None, out, idle))
        out = sampled.tokens
    jax.block_until_ready(out)
    return (time.perf_counter() - start) * 1e3 / steps


def load(model: str, share: float, args, overrides: dict, workdir: Path):
    """A fresh engine at resident `share` (bench/roofline.py's load_config, the profile's miss
    policy)."""
    engine, _ = load_config(model, share, None, args, overrides, workdir, max_context=1024)
    return engine


def measure(engine, share: float, args) -> list[str]:
    start = time.perf_counter()
    # compiles before the clock: the prefill (twice: the boot state may be placed otherwise than
    # a step leaves it), the decode step, a counter drain and the swaps a plan queues after it
    loop_ms(engine, max(args.lanes), engine.config.residency.drain_every + 8)
    for lanes in args.lanes:
        loop_ms(engine, lanes, 2)
    engine_ms(engine, 1, 2)
    bare_ms(engine, 1, 2)
    print(f"[{share:.0%}] warm-up (compile) {time.perf_counter() - start:.1f} s", flush=True)
    rows = []
    for lanes in args.lanes:
        loop, eng, bare = (loop_ms(engine, lanes, args.steps), engine_ms(engine, lanes, args.steps),
                           bare_ms(engine, lanes, args.steps))
        rows.append(f"| {share:.0%} | {engine.residency.options.miss_policy} | {lanes} | "
                    f"{loop:.3f} | {eng:.3f} | {bare:.3f} | {loop / bare:.2f} |")
        print(rows[-1], flush=True)
    return rows


HEADER = ("| resident | policy | lanes | loop ms/step | engine ms/step | bare ms/step | "
          "loop/bare |\n| --- | --- | --- | --- | --- | --- | --- |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per measurement")
    parser.add_argument("--lanes", default="1,4")
    parser.add_argument("--resident", default="1.0,0.65", help="resident shares, comma-separated")
    parser.add_argument("--trace", default="en", help="routing trace to replay ('' = the router's own)")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    args = parser.parse_args(argv)
    args.lanes = [int(x) for x in args.lanes.split(",")]
    overrides = parse_set(args.set)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for share in (float(x) for x in args.resident.split(",")):
            engine = load(args.model, share, args, overrides, Path(tmp))
            rows += measure(engine, share, args)
            del engine
            gc.collect()  # the engine and its scheduler refer to each other: free its memory
    print("\n" + HEADER + "\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
