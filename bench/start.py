"""Cold and warm start: seconds from a fresh process to its first generated tokens, with
`engine.compile_cache` empty (cold: every step compiled) and then filled by that first run (warm:
the compiled steps read back), plus the load's share (weights read and placed) and the warm-up's
(every step shape compiled, as a server does before it reports ready).

    python -m bench.start MODEL_DIR [--cache DIR] [--set table.key=value ...]

Each run is its own process (`tidejax.load`, `Engine.warmup`, then `generate` of 8 tokens, as a
server starts); the cache folder is
emptied before the cold run. The page cache is warm for both (the cold run reads the weights
first), so the difference is compilation. A second table sums jax.monitoring's duration events
of each run: tracing, lowering to MLIR, XLA's compile (on a cache hit: the executable loaded) and
the cache's read.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

ONE_START = """
import collections, json, sys, time
t0 = time.time()
from jax import monitoring
spent = collections.defaultdict(lambda: [0.0, 0])
def count(event, seconds, **_):
    spent[event][0] += seconds
    spent[event][1] += 1
monitoring.register_event_duration_secs_listener(count)
import tidejax
from tidejax.config import parse_set
overrides = {}
for item in json.loads(sys.argv[3]):
    for table, values in parse_set(item).items():
        overrides.setdefault(table, {}).update(values)
overrides.setdefault("engine", {})["compile_cache"] = sys.argv[2]
engine = tidejax.load(sys.argv[1], **overrides)
t1 = time.time()
engine.warmup()
t2 = time.time()
engine.generate("The tide", max_new_tokens=8)
print("RESULT", json.dumps({"load_s": t1 - t0, "warmup_s": t2 - t1, "ready_s": time.time() - t0,
                            "spent": spent}))
"""

# jax.monitoring's duration events: where a start's compile-side seconds go
EVENTS = {"trace": "/jax/core/compile/jaxpr_trace_duration",
          "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
          "compile": "/jax/core/compile/backend_compile_duration",
          "cache read": "/jax/compilation_cache/cache_retrieval_time_sec"}


def start(model: str, cache: Path, sets: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", ONE_START, model, str(cache), json.dumps(sets)],
                         capture_output=True, text=True, cwd=REPO)
    if out.returncode:
        raise SystemExit(f"error: the start failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.split("RESULT", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint directory or profile")
    parser.add_argument("--cache", help="compile cache folder (default: a temporary one)")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    args = parser.parse_args()
    cache = Path(args.cache or tempfile.mkdtemp(prefix="tidejax-xla-"))
    shutil.rmtree(cache, ignore_errors=True)
    cold = start(args.model, cache, args.set)
    warm = start(args.model, cache, args.set)
    xla = sum(1 for path in cache.iterdir() if path.is_file())
    steps = sum(1 for _ in (cache / "steps").glob("*.exe"))
    print("| start | load s | warm-up s | ready s (8 tokens out) |\n| --- | --- | --- | --- |")
    for name, run in (("cold", cold), ("warm", warm)):
        print(f"| {name} | {run['load_s']:.1f} | {run['warmup_s']:.1f} | {run['ready_s']:.1f} |")
    print(f"({xla} XLA executables and {steps} step executables cached in {cache})\n")
    print("| start | " + " | ".join(f"{name} s (calls)" for name in EVENTS) + " |")
    print("| --- |" + " --- |" * len(EVENTS))
    for name, run in (("cold", cold), ("warm", warm)):
        cells = [run["spent"].get(event, [0.0, 0]) for event in EVENTS.values()]
        print(f"| {name} | " + " | ".join(f"{s:.1f} ({n})" for s, n in cells) + " |")
    print("(compile: XLA's, or the cache's executable loaded, on a cache hit)")


if __name__ == "__main__":
    main()
