"""What a DeepSeek-V4.1 step costs to compile: trace + lowering seconds, XLA's compile seconds
and the program's size, for the decode step at 1 and 4 lanes and one prompt chunk.

    python -m bench.compile_time [MODEL_DIR] [--lanes 1,4] [--chunk 64] [--repeats 2]
        [--code DIR,DIR]

Without MODEL_DIR it writes the 40-layer ds41-flash schedule at tiny widths (`python -m
tools.make_synthetic DIR --shape ds41-tiny --layers 40`: hidden 64, 8 experts a layer) into a
temporary folder, so it runs on a CPU. Each measurement is its own process (nothing traced or
compiled before it, no compilation cache): `tidejax.load` with engine.lanes = the lanes, then
the step of one warm-up shape (LoadedModel.warmup_inputs: the decode width of one page, and for
the chunk a prompt chunk of --chunk tokens beside one lane) lowered (Runner.lower) and compiled.

Columns: trace and lower, jax.monitoring's duration events (tracing the step to a jaxpr,
lowering it to StableHLO); compile, XLA's backend compile; StableHLO ops, the lowered module's
operations; HLO ops, the instructions of the optimized HLO XLA compiled. --repeats runs every
measurement that many times in turn (the machine's load varies: compare rows of one repeat).
--code names checkouts whose code is measured instead of this one's (`git archive REV | tar -x
-C DIR` makes one), each step in one after the other, back to back: an A/B of two revisions on
a loaded machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

ONE_SHAPE = """
import collections, json, sys
from jax import monitoring
spent = collections.defaultdict(float)
monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **_: spent.__setitem__(event, spent[event] + seconds))
import importlib.util, tidejax
model, lanes, chunk, this = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
spec = importlib.util.spec_from_file_location("compile_time", this)  # the other checkout
bench = importlib.util.module_from_spec(spec)  # need not have this file
spec.loader.exec_module(bench)
engine = tidejax.load(model, engine={"lanes": lanes, "prefill_chunk": max(chunk, 1),
                                     "max_context": 256, "page_size": 64})
print("RESULT", json.dumps(bench.measure(engine, chunk, spent)))
"""

# jax.monitoring's duration events
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE = "/jax/core/compile/backend_compile_duration"
STABLEHLO_OP = re.compile(r"^\s*(?:%[^=]+= )?\"?(?:stablehlo|chlo|func|sdy|mhlo)\.", re.M)
HLO_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = ", re.M)


def measure(engine, chunk: int, spent: dict) -> dict:
    """The step of one shape (decode alone where chunk is 0, else a chunk of `chunk` tokens
    beside the lanes) lowered and compiled in this process: seconds and op counts."""
    loaded = engine.loaded
    shapes = loaded.warmup_shapes()
    size, width, decode_width = min(s for s in shapes if s[0] == chunk)
    inputs = loaded.warmup_inputs(size, width, decode_width, engine.residency.idle_batch())
    before = dict(spent)
    lowered = engine.runner.lower(inputs)
    compiled = lowered.compile()
    return {"trace_s": spent[TRACE] - before.get(TRACE, 0.0),
            "lower_s": spent[LOWER] - before.get(LOWER, 0.0),
            "compile_s": spent[COMPILE] - before.get(COMPILE, 0.0),
            "stablehlo_ops": len(STABLEHLO_OP.findall(lowered.as_text())),
            "hlo_ops": len(HLO_OP.findall(compiled.as_text()))}


def one(code: Path, model: str, lanes: int, chunk: int) -> dict:
    """One measurement in a fresh process running the code of checkout `code`."""
    out = subprocess.run([sys.executable, "-c", ONE_SHAPE, model, str(lanes), str(chunk),
                          __file__],
                         capture_output=True, text=True, cwd=code,
                         env={**os.environ, "PYTHONPATH": str(code)})
    if out.returncode:
        raise SystemExit(f"error: the measurement failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.split("RESULT", 1)[1])


def write_model(folder: Path) -> str:
    from tools import make_synthetic

    make_synthetic.main([str(folder), "--shape", "ds41-tiny", "--layers", "40"])
    return str(folder)


HEADER = ("| repeat | step | code | trace s | lower s | compile s | StableHLO ops | HLO ops |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="checkpoint directory (default: write the "
                        "40-layer ds41-tiny synthetic)")
    parser.add_argument("--lanes", default="1,4", help="decode lanes, comma-separated")
    parser.add_argument("--chunk", type=int, default=64, help="prompt tokens of the chunk "
                        "measured (beside one lane; 0: none)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--code", default=str(REPO), help="checkouts whose code is measured, "
                        "comma-separated (default: this one)")
    args = parser.parse_args(argv)
    codes = [Path(c).resolve() for c in args.code.split(",")]
    steps = [(int(n), 0, f"decode, {n} lane{'s' if int(n) > 1 else ''}")
             for n in args.lanes.split(",")]
    if args.chunk:
        steps.append((1, args.chunk, f"prompt chunk of {args.chunk} + 1 lane"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_model(Path(tmp) / "ds41x40")
        for repeat in range(1, args.repeats + 1):
            for (lanes, chunk, name), code in itertools.product(steps, codes):
                r = one(code, model, lanes, chunk)
                rows.append(f"| {repeat} | {name} | {code.name} | {r['trace_s']:.1f} | "
                            f"{r['lower_s']:.1f} | {r['compile_s']:.1f} | {r['stablehlo_ops']} | "
                            f"{r['hlo_ops']} |")
                print(rows[-1], flush=True)
    print("\n" + HEADER + "\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
