"""Whether the `ring` policy's copies overlap the step's layers (residency/ring.py): the compiled
decode step's ring fetch (named scope `ring_fetch`) and where its schedule puts it, and ms a bare
step under `ring` beside `substitute` (the same step without the copies).

    python -m bench.ring_overlap MODEL_DIR [--resident 0.625] [--ring-slots 8] [--steps 64]
        [--lanes 1] [--trace ''] [--set table.key=value ...]

Per policy: a fresh engine (bench/step_overhead.py's load), the step's optimized HLO, and
bench/step_overhead.py's bare ms a step (the batch idle, so under `ring` each step fetches its
`min(ring_slots, max_swaps_per_step)` staged rows again: the copies' whole cost). It prints, for
`ring`, the opcodes of the instructions under `ring_fetch` (on the GPU `async-start` /
`async-done` or `copy-start` / `copy-done` pairs where XLA made the host reads asynchronous; a
`fusion` reading host memory where it did not) with their places in the schedule beside the
first and last MoE kernel's, then both policies' ms a step. The copies overlap when `ring`'s
ms a step is about `substitute`'s; run serially they add R x ~0.44 ms (an 18.8 MB MXFP4 row at
43 GB/s).
"""

from __future__ import annotations

import argparse
import collections
import gc
import re
import sys
import tempfile
from pathlib import Path

import jax


from bench.roofline import parse_set
from bench.step_overhead import _decode_rows, _first_step, bare_ms, load

# name = type opcode(...: a tuple type (with spaces, nested parentheses) or a plain one
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(?:\(.*?\)|\S+)\s+([\w\-]+)\(.*$",
                    re.M)


def schedule(hlo_text: str) -> list[tuple[str, str, str]]:
    """The ENTRY computation's instructions in schedule order: (name, opcode, the line)."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    return [(m.group(1), m.group(2), m.group(0)) for m in _INSTR.finditer(entry)]


def ring_places(engine, lanes: int) -> list[str]:
    """Lines describing the compiled step's ring fetch and the MoE kernels around it."""
    tokens = _first_step(engine, lanes)
    inputs = engine.loaded.step_inputs(_decode_rows(engine, lanes, False), None, tokens,
                                       engine.residency.idle_batch())
    text = engine.runner.lower(inputs).compile().as_text()
    order = schedule(text)
    fetch = [(i, op) for i, (_, op, line) in enumerate(order) if "ring_fetch" in line]
    moe = [i for i, (_, _, line) in enumerate(order) if "moe_grouped" in line]
    counts = collections.Counter(op for _, op in fetch)
    out = [f"ring_fetch instructions: {dict(counts)} (of {len(order)} in the schedule)",
           f"MoE kernels at schedule places {moe[0] if moe else '-'} .. {moe[-1] if moe else '-'}"]
    out += [f"  {i:5d} {op}" for i, op in fetch[:16]]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="checkpoint directory")
    parser.add_argument("--resident", type=float, default=0.625)
    parser.add_argument("--ring-slots", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64, help="bare steps timed")
    parser.add_argument("--lanes", type=int, default=1)
    parser.add_argument("--trace", default="", help="routing trace to replay ('' = the router's own)")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    args = parser.parse_args(argv)
    lanes = args.lanes
    args.lanes = [lanes]  # step_overhead's load sizes the engine by the most lanes
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy in ("ring", "substitute"):
            overrides = parse_set(args.set + [f"residency.miss_policy={policy}"] + (
                [f"residency.ring_slots={args.ring_slots}"] if policy == "ring" else []))
            engine = load(args.model, args.resident, args, overrides, Path(tmp))
            if policy == "ring":
                print("\n".join(ring_places(engine, lanes)), flush=True)
            bare_ms(engine, lanes, 2)  # compiled and warm
            rows.append((policy, bare_ms(engine, lanes, args.steps)))
            del engine
            gc.collect()
    print("\n| policy | resident | lanes | bare ms a step |\n| --- | --- | --- | --- |")
    for policy, ms in rows:
        print(f"| {policy} | {args.resident:.1%} | {lanes} | {ms:.3f} |")
    print(f"ring - substitute: {rows[0][1] - rows[1][1]:.3f} ms a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
