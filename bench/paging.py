"""The paged KV pool and mixed prefill on a real-depth model: decode tok/s against max_context,
and what a long prompt's arrival does to a lane that is decoding.

    python -m bench.paging MODEL_DIR [--contexts 4096,131072] [--lanes 1,4] [--tokens 64]
        [--prompt 8192] [--chunks 256,512,2048 | ""] [--trace en] [--set table.key=value ...]

Per max_context (a fresh `tidejax.load`, every expert resident, routing replayed from --trace):
decode tok/s at each lane count (lanes / median step over --tokens steps, 16-token prompts) and
the KV pool's bytes beside the dense per-lane layout's (lanes x max_context). Then, on the last
engine, per prefill chunk size (none with --chunks ""): the --prompt-token prompt's TTFT on an
idle engine, and again while one lane decodes: the decoding lane's gaps between tokens while the
prompt is admitted (median and largest), the mixed steps (median and longest), and the prompt's
TTFT. Prints a markdown table and writes it to $OUT/paging.md when $OUT is set.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

from bench.roofline import drive, load_config, parse_set, prompt_ids, raise_errors, report
from tidejax.runtime.sampling import SamplingParams
from tidejax.runtime.scheduler import GenerationRequest, TokenEvent

PROMPT_TOKENS = 16


def decode_tps(engine, lanes: int, tokens: int, domain: str) -> float:
    """lanes / median seconds of the steps where all `lanes` requests decode."""
    prompts = [prompt_ids(engine, domain, PROMPT_TOKENS, offset=997 * i) for i in range(lanes)]
    records = drive(engine, prompts, tokens)
    steady = [r.seconds for r in records if r.active == lanes and not r.prefill][2:-2]
    return lanes / statistics.median(steady)


def ttft(engine, ids: list[int]) -> float:
    """Seconds from submit to the first token on an otherwise idle engine."""
    first = []
    start = time.perf_counter()
    engine.scheduler.submit(GenerationRequest(ids, 1, SamplingParams(), ignore_eos=True),
                            lambda e: first.append(time.perf_counter() - start)
                            if isinstance(e, TokenEvent) and not first else raise_errors(e))
    engine.scheduler.run_until_idle()
    return first[0]


def busy_arrival(engine, ids: list[int], domain: str) -> dict:
    """One lane decodes; the prompt arrives; until its first token: the decoding lane's token
    gaps (s), the step times (s) and the prompt's TTFT."""
    scheduler = engine.scheduler
    arrivals, first = [], []
    scheduler.submit(GenerationRequest(prompt_ids(engine, domain, PROMPT_TOKENS), 100000,
                                       SamplingParams(), ignore_eos=True),
                     lambda e: arrivals.append(time.perf_counter())
                     if isinstance(e, TokenEvent) else raise_errors(e))
    while len(arrivals) < 8:
        scheduler.step()
    submitted = time.perf_counter()
    handle = scheduler.submit(GenerationRequest(ids, 1, SamplingParams(), ignore_eos=True),
                              lambda e: first.append(time.perf_counter())
                              if isinstance(e, TokenEvent) else raise_errors(e))
    seen, steps = len(arrivals), []
    while not first:
        start = time.perf_counter()
        scheduler.step()
        steps.append(time.perf_counter() - start)
    during = arrivals[seen - 1:]
    gaps = [b - a for a, b in zip(during, during[1:])]
    for lane, h in enumerate(scheduler.lane_of):  # end the decoding request
        if h is not None:
            h.cancel()
    handle.cancel()
    scheduler.run_until_idle()
    return {"gaps": gaps, "steps": steps, "ttft": first[0] - submitted,
            "tokens_during": len(during) - 1}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--contexts", default="4096,131072")
    parser.add_argument("--lanes", default="1,4")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--chunks", default="256,512,2048")
    parser.add_argument("--trace", default="en")
    parser.add_argument("--domain", default="en")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    args = parser.parse_args(argv)
    args.lanes = [int(x) for x in args.lanes.split(",")]
    chunks = [int(x) for x in args.chunks.split(",") if x]  # none: decode tok/s only
    overrides = parse_set(args.set)
    # the arriving prompt needs a lane beside the decoding one
    overrides.setdefault("engine", {}).setdefault("lanes", max(max(args.lanes), 2))
    device = jax.devices()[0].device_kind
    print(f"jax {jax.__version__} on {device}", flush=True)
    lines = ["| max_context | lanes | decode tok/s | KV pool GB | dense layout GB |",
             "| --- | --- | --- | --- | --- |"]
    mixed = ["| prefill_chunk | TTFT idle s | TTFT busy s | busy / idle | mixed step ms median / max "
             "| gap ms median | gap ms max | max gap / longest mixed step | decode tokens during |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory() as tmp:
        for max_context in (int(x) for x in args.contexts.split(",")):
            engine, _ = load_config(args.model, 1.0, None, args, overrides, Path(tmp), max_context)
            start = time.perf_counter()
            engine.warmup([PROMPT_TOKENS])
            print(f"[{max_context}] warm-up {time.perf_counter() - start:.1f} s", flush=True)
            kv = engine.kv_stats()
            for lanes in args.lanes:
                tps = decode_tps(engine, lanes, args.tokens, args.domain)
                lines.append(f"| {max_context} | {lanes} | {tps:.1f} | {kv['kv_bytes'] / 1e9:.2f} | "
                             f"{kv['dense_kv_bytes'] / 1e9:.2f} |")
                print(lines[-1], flush=True)
        ids = prompt_ids(engine, args.domain, args.prompt)
        for chunk in chunks:
            engine.set_prefill_chunk(chunk)
            start = time.perf_counter()
            engine.warmup([args.prompt])
            print(f"[chunk {chunk}] warm-up {time.perf_counter() - start:.1f} s", flush=True)
            # each measured twice, the first run compiling what warmup did not (the reference's
            # decode tables widen with the decoding lane's length)
            idle = min(ttft(engine, ids) for _ in range(2))
            busy = [busy_arrival(engine, ids, args.domain) for _ in range(2)][-1]
            # a chunk's step costs more the further into the prompt it lies (it sees more keys):
            # the largest gap is set against the longest mixed step
            steps, gaps = busy["steps"], busy["gaps"]
            mixed.append(f"| {chunk} | {idle:.3f} | {busy['ttft']:.3f} | {busy['ttft'] / idle:.2f} | "
                         f"{statistics.median(steps) * 1e3:.1f} / {max(steps) * 1e3:.1f} | "
                         f"{statistics.median(gaps) * 1e3:.1f} | {max(gaps) * 1e3:.1f} | "
                         f"{max(gaps) / max(steps):.2f} | {busy['tokens_during']} |")
            print(mixed[-1], flush=True)
            print(f"[chunk {chunk}] gaps ms: " + " ".join(f"{g * 1e3:.0f}" for g in gaps), flush=True)
    report("paging.md", f"{datetime.date.today()}, jax {jax.__version__}, {device}, "
           f"`python -m bench.paging {' '.join(argv or sys.argv[1:])}`\n\n"
           + "\n".join(lines) + "\n\n" + "\n".join(mixed) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
