"""Loading alone: a checkpoint's dense params and routed-expert pool read and placed
(runtime.build.load_weights, the path every family takes), in a fresh process with the page
cache warm; GB/s of checkpoint bytes and the process's memory high-water over the load.

    python -m bench.load MODEL_DIR [--dtype bfloat16] [--experts checkpoint|bf16|mxfp4]

`grown` is the RSS high-water mark after the load less the one before it (imports, the
runtime's start and a first host buffer already paid); the pool's bytes are its placed leaves'.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

ONE_LOAD = """
import json, resource, sys, time
from pathlib import Path
import jax, numpy as np
from tidejax import parallel
from tidejax.fields import read_json
from tidejax.models.registry import family_for
from tidejax.residency.pool import host_pool
from tidejax.residency.serve import ServeOptions
from tidejax.runtime.build import _DTYPES, load_weights
model_dir, dtype, held_as = Path(sys.argv[1]), _DTYPES[sys.argv[2]], sys.argv[3]
raw = read_json(model_dir / "config.json")
family = family_for(raw, "config.json")
cfg = family.config_from_hf(raw, "config.json")
serve = ServeOptions(swiglu_limit=float(family.swiglu_limit(cfg)))
small = host_pool({"gate_up": np.ones((2, 4, 8), np.float32), "down": np.ones((2, 8, 2), np.float32)})
parallel.host_buffer(small["down"])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
start = time.perf_counter()
params, aux, pool = load_weights(family, cfg, model_dir, raw, serve, dtype, held_as)
jax.block_until_ready((params, pool))
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT", json.dumps({"seconds": seconds, "grown": peak - before,
      "pool": sum(a.nbytes for a in jax.tree.leaves(pool)),
      "dense": sum(a.nbytes for a in jax.tree.leaves(params)),
      "pool_memory": sorted({a.sharding.memory_kind for a in jax.tree.leaves(pool)})}))
"""


def checkpoint_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def measure(model_dir: Path, dtype: str = "float32", experts: str = "checkpoint",
            env: dict | None = None) -> dict:
    """One load in a fresh process: seconds, grown, pool and dense bytes, the pool's memory."""
    for f in Path(model_dir).glob("*.safetensors"):  # the page cache warm, as for start.py
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    out = subprocess.run([sys.executable, "-c", ONE_LOAD, str(model_dir), dtype, experts],
                         capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, **(env or {})})
    if out.returncode:
        raise RuntimeError(f"the load failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.split("RESULT", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--experts", default="checkpoint", choices=("checkpoint", "bf16", "mxfp4"))
    args = parser.parse_args()
    r = measure(args.model, args.dtype, args.experts)
    gb = checkpoint_bytes(args.model) / 1e9
    print("| checkpoint GB | load s | GB/s | pool GB | dense GB | grown GB | grown / pool |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {gb:.2f} | {r['seconds']:.1f} | {gb / r['seconds']:.2f} | {r['pool'] / 1e9:.2f} | "
          f"{r['dense'] / 1e9:.2f} | {r['grown'] / 1e9:.2f} | {r['grown'] / r['pool']:.2f} |")
    print(f"(pool in {', '.join(map(str, r['pool_memory']))} memory)")


if __name__ == "__main__":
    main()
