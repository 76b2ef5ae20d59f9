"""Where a decode step's device time goes: the jitted step (as bench/step_overhead.py's "bare"
runs it) traced with the JAX profiler, its kernels summed by the model part that issued them.

    python -m bench.profile_step MODEL_DIR [--steps 16] [--lanes 1,4] [--prefill 0,2048]
        [--resident 1.0,0.65] [--trace en] [--set table.key=value ...]

Per resident share: a fresh engine (bench/step_overhead.py's load, engine.lanes = the most
--lanes), then per (lanes, prefill) case `--steps` bare steps under `jax.profiler.trace`: the
decoding lanes, beside a prompt chunk of `prefill` tokens where it is not 0 (written over the same
pages each step). Every op execution the trace holds (events naming an `hlo_op`,
on the device's streams where there are any, the host's XLA threads on the CPU) is attributed to
the `op_name` that the compiled step's HLO gives it: flax module paths with the layer index
dropped (`layers_7/self_attn` -> `layers/self_attn`) and the kernels' named scopes
(`moe_grouped_pallas`, `paged_mla_decode_pallas`). It prints, per case, the step's wall time
(back to back, untraced), the kernels a step, the device's busy time (the union of the ops'
intervals) and its idle time inside the traced span (the host gaps), then ms a step by part (the
first `--depth` path components, 3 by default) and the costliest ops.
"""

from __future__ import annotations

import argparse
import collections
import gc
import gzip
import itertools
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import jax


from bench.roofline import parse_set
from bench.step_overhead import _decode_rows, _first_step, _step_windows, load
from tidejax.kv.pages import pages_for
from tidejax.runtime.steps import PrefillChunk

_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name=\"([^\"]*)\"", re.M)
_LAYER = re.compile(r"(layers?)_\d+")


def op_scopes(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its op_name (the jit and layer indices dropped), from the compiled
    module's text."""
    scopes = {}
    for name, op_name in _OP.findall(hlo_text):
        path = op_name.split("/")
        if path and path[0].startswith("jit("):
            path = path[1:]
        scopes[name] = _LAYER.sub(r"\1", "/".join(path))
    return scopes


def trace_events(folder: Path) -> list[dict]:
    """The op executions of the newest trace under `folder`: complete events that name an
    hlo_op, on the device's processes where there are any, else all (the CPU's XLA threads)."""
    files = sorted(folder.glob("plugins/profile/*/*.trace.json.gz"))
    if not files:
        raise SystemExit(f"error: no trace written under {folder}")
    with gzip.open(files[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    device = [e for e in ops if procs.get(e["pid"], "").startswith("/device:")]
    return device or ops


def summarize(events: list[dict], scopes: dict[str, str], steps: int, depth: int = 2):
    """(ms a step by part [(part, ms)], ms a step by op [(op, part, count a step, ms)]), each
    costliest first; a part is the op_name's first `depth` components ('?' where the HLO names
    none)."""
    by_part, by_op, count = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        op = e["args"]["hlo_op"]
        part = "/".join(scopes.get(op, "?").split("/")[:depth]) or "?"
        by_part[part] += e["dur"]
        by_op[(op, part)] += e["dur"]
        count[(op, part)] += 1
    parts = [(part, us / 1e3 / steps) for part, us in by_part.most_common()]
    ops = [(op, part, count[(op, part)] / steps, us / 1e3 / steps)
           for (op, part), us in by_op.most_common()]
    return parts, ops


def timeline(events: list[dict], steps: int) -> dict:
    """Kernels, busy ms (the union of the ops' intervals: overlapping streams count once) and
    idle ms inside the traced span, each a step."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    busy, end = 0.0, spans[0][0]
    for start, stop in spans:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - spans[0][0]
    return {"kernels": len(events) / steps, "busy_ms": busy / 1e3 / steps,
            "idle_ms": (span - busy) / 1e3 / steps}


def profile(engine, lanes: int, prefill: int, steps: int, folder: Path):
    """`steps` bare steps of `lanes` decoding lanes (and a prompt chunk of `prefill` tokens on
    the last lane, where not 0), timed back to back, then again under the profiler; returns (wall
    ms a step, the trace's events, the step's op scopes)."""
    tokens = _first_step(engine, lanes)
    decode = _decode_rows(engine, lanes, False)
    chunk = None
    if prefill:
        lane = engine.lanes - 1
        decode.active[lane] = False
        chunk = PrefillChunk(lane, [1] * prefill, 0,
                             list(range(pages_for(prefill, engine.loaded.page_size))))

    def inputs(step: int = 0):
        decode.windows = _step_windows(engine, step)  # the routing moves on step to step
        if chunk is not None:
            chunk.window = int(decode.windows[chunk.lane])
        return engine.loaded.step_inputs(decode, chunk, tokens, engine.residency.idle_batch())

    def run(n: int):
        nonlocal tokens
        for step in range(n):
            sampled, _ = engine.runner.dispatch(inputs(step))
            tokens = sampled.tokens
        jax.block_until_ready(tokens)

    start = time.perf_counter()
    scopes = op_scopes(engine.runner.lower(inputs()).compile().as_text())
    print(f"[{lanes} lanes, prefill {prefill}] lowered and compiled in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    run(2)  # compiled and warm before the clock
    start = time.perf_counter()
    run(steps)
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(str(folder), create_perfetto_trace=True, profiler_options=options):
        run(steps)
    return wall_ms, trace_events(folder), scopes


def report(label: str, wall_ms: float, events, scopes, args) -> None:
    parts, ops = summarize(events, scopes, args.steps, args.depth)
    total = sum(ms for _, ms in parts)
    line = timeline(events, args.steps)
    print(f"\n[{label}] wall {wall_ms:.3f} ms a step; {line['kernels']:.0f} kernels, busy "
          f"{line['busy_ms']:.3f} ms, idle {line['idle_ms']:.3f} ms a step; {total:.3f} ms of ops"
          "\n\n| part | ms a step | share |\n| --- | --- | --- |")
    for part, ms in parts:
        print(f"| {part} | {ms:.3f} | {ms / total:.1%} |")
    print("\n| op | part | a step | ms a step |\n| --- | --- | --- | --- |")
    for op, part, n, ms in ops[:args.top]:
        print(f"| {op} | {part} | {n:g} | {ms:.3f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=16, help="decode steps traced")
    parser.add_argument("--lanes", default="1", help="decoding lanes, comma-separated")
    parser.add_argument("--prefill", default="0",
                        help="prompt tokens a step carries beside the lanes, comma-separated")
    parser.add_argument("--resident", default="1.0,0.65", help="resident shares, comma-separated")
    parser.add_argument("--trace", default="en", help="routing trace to replay ('' = the router's own)")
    parser.add_argument("--depth", type=int, default=3, help="op_name components a part keeps")
    parser.add_argument("--top", type=int, default=12, help="costliest ops listed")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    args = parser.parse_args(argv)
    args.lanes = [int(x) for x in args.lanes.split(",")]  # load sizes the engine by the most
    chunks = [int(x) for x in args.prefill.split(",")]
    overrides = parse_set(args.set)
    overrides.setdefault("engine", {}).setdefault("max_context", max(1024, 2 * max(chunks)))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for share in (float(x) for x in args.resident.split(",")):
            engine = load(args.model, share, args, overrides, Path(tmp))
            for lanes, prefill in itertools.product(args.lanes, chunks):
                folder = Path(tmp) / f"trace-{share}-{lanes}-{prefill}"
                wall_ms, events, scopes = profile(engine, lanes, prefill, args.steps, folder)
                report(f"{share:.0%}, {engine.residency.options.miss_policy}, {lanes} lanes, "
                       f"prefill {prefill}", wall_ms, events, scopes, args)
            del engine
            gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
