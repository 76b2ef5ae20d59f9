"""A verify step of k + 1 positions a lane against a one-token decode step (issue 33): the cost
that bounds speculative decoding's speedup at any acceptance.

    python -m bench.verify_step MODEL [--ks 1,2,3,4] [--lanes 1,4] [--tokens 48]
        [--trace ''] [--set table.key=value ...]

MODEL is a checkpoint with an MTP layer (`python -m tools.make_synthetic DIR --layers 40
--n-experts 16 --mtp-layers 1`: the V3-family synthetic). For speculation off and then
`[speculative] method = "mtp"` with tokens = k for each of --ks, a fresh engine (all experts
resident, the prompt cache off; roofline.load_config) decodes --tokens tokens on each of
LANES prompts of held-out text (roofline.steady_decode: the steps with every lane decoding,
past the first two); the step's time is the median of those. Prints a markdown table: per k
and lanes the step's ms, its ratio to the one-token step's at the same lanes, the tokens a
steady step yielded a lane (its accepted drafts + 1), the run's accepted and drafted tokens,
and the bound (k + 1) / ratio: the speedup were every draft accepted. Writes it to
$OUT/verify_step.md where $OUT is set. The engines compile lazily (engine.warmup false unless --set says otherwise): the
steps before the steady ones compile.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import tempfile
from pathlib import Path

import jax

from bench.roofline import load_config, parse_set, report, steady_decode


def measure(model: str, k: int, args, overrides: dict, workdir: Path) -> list[tuple]:
    """[(lanes, median step seconds, tokens a step a lane, accepted, drafted)] of one engine:
    speculation off (k = 0) or the MTP layer drafting k tokens a step."""
    tables = {name: dict(table) for name, table in overrides.items()}
    tables.setdefault("engine", {}).setdefault("warmup", False)
    tables["speculative"] = {"method": "mtp", "tokens": k} if k else {"method": "none"}
    engine, _ = load_config(model, 1.0, None, args, tables, workdir, 64 + args.tokens + 64)
    try:
        out = []
        for lanes in args.lanes:
            before = dict(engine.scheduler.totals)
            made, last = {}, before.get("generated_tokens", 0)  # id(record) -> its tokens

            def count(record):
                nonlocal last
                now = engine.scheduler.totals["generated_tokens"]
                made[id(record)], last = now - last, now
            _, steady = steady_decode(engine, lanes, args.tokens, args.domain, on_step=count)
            totals = engine.scheduler.totals
            out.append((lanes, statistics.median(r.seconds for r in steady),
                        sum(made[id(r)] for r in steady) / len(steady) / lanes,
                        *(totals[n] - before.get(n, 0) for n in ("accepted_tokens",
                                                                 "drafted_tokens"))))
        return out
    finally:
        engine.close()
        del engine
        gc.collect()  # free the pool and the bank before the next engine loads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="checkpoint directory with an MTP layer")
    parser.add_argument("--ks", default="1,2,3,4", help="drafted tokens a step, comma-separated")
    parser.add_argument("--lanes", default="1,4")
    parser.add_argument("--tokens", type=int, default=48, help="decoded tokens per request")
    parser.add_argument("--trace", default="", help="routing trace to replay ('' = the router's own)")
    parser.add_argument("--domain", default="en", help="held-out text for the prompts")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    args = parser.parse_args(argv)
    args.lanes = [int(x) for x in args.lanes.split(",")]
    ks = [int(x) for x in args.ks.split(",")]
    if any(k < 1 for k in ks):
        parser.error(f"--ks {args.ks}: each k is at least 1 (0, speculation off, always runs)")
    overrides = parse_set(args.set)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = {k: measure(args.model, k, args, overrides, Path(tmp)) for k in [0, *ks]}
    one = {row[0]: row[1] for row in results[0]}
    lines = ["| k | lanes | positions a lane | step ms | vs one-token step | tokens a step a "
             "lane | accepted / drafted | bound (k + 1) / ratio |", "|" + " --- |" * 8]
    for k, rows in results.items():
        for lanes, seconds, tokens, accepted, drafted in rows:
            ratio = seconds / one[lanes]
            lines.append(f"| {k} | {lanes} | {k + 1} | {seconds * 1e3:.2f} | {ratio:.2f}x | "
                         f"{tokens:.2f} | {accepted} / {drafted} | {(k + 1) / ratio:.2f}x |")
    text = (f"{datetime.date.today()}, jax {jax.__version__} on {jax.devices()[0].device_kind}, "
            f"{args.model}: {args.tokens} tokens a lane, the steady steps' median\n\n"
            + "\n".join(lines) + "\n")
    report("verify_step.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
