"""The `cpu` miss policy's host kernel (tidejax.residency.cpu.moe_host) on this machine's CPU:
GB/s of expert bytes (MXFP4 codes and scales, or bf16 values) a layer's missed picks stream,
over distinct experts x tokens a step, per ISA path.

    python3 bench/cpu_experts.py [--hidden 5120] [--intermediate 2304] [--experts 1,3,6]
        [--tokens 1,4,16] [--formats mxfp4,bf16] [--isas best|all] [--pool 24]

Expert shapes default to the V3-family synthetic's and DeepSeek-V4.1-Flash's (hidden 5120,
intermediate 2304: 18.9 MB an MXFP4 expert). The pool holds `--pool` random experts (more bytes
than the last-level cache), and each call takes the next ones in turn, so every call streams its
experts from memory, as a decode step does. Each of `tokens` tokens picks every one of the
`experts` experts. Prints a markdown table (also $OUT/cpu_experts.md under the device tool).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tidejax.pallas.bank import bank_dims  # noqa: E402
from tidejax.residency import cpu  # noqa: E402
from tidejax.residency.pool import row_bytes  # noqa: E402


def random_pool(fmt: str, n: int, d: int, inter: int, seed: int = 0) -> dict:
    """n random experts in a bank format (MXFP4: random codes, scales near 2**-4)."""
    r = np.random.default_rng(seed)
    if fmt == "mxfp4":
        return {"gate_up_blocks": r.integers(0, 256, (n, 2 * inter, d // 32, 16), np.uint8),
                "gate_up_scales": r.integers(118, 126, (n, 2 * inter, d // 32), np.uint8),
                "down_blocks": r.integers(0, 256, (n, d, inter // 32, 16), np.uint8),
                "down_scales": r.integers(118, 126, (n, d, inter // 32), np.uint8)}
    bf16 = ml_dtypes.bfloat16
    return {"gate_up": (r.standard_normal((n, 2 * inter, d), np.float32) * 0.02).astype(bf16),
            "down": (r.standard_normal((n, d, inter), np.float32) * 0.02).astype(bf16)}


def host_gbps(pool: dict, experts: int, tokens: int, isa: str | None = None,
              reps: int = 9) -> float:
    """Median GB/s of moe_host over `experts` distinct experts of `pool` (the next ones each call)
    picked by each of `tokens` tokens."""
    n = next(iter(pool.values())).shape[0]
    d = bank_dims(pool)[1]
    x = np.random.default_rng(1).standard_normal((tokens, d), np.float32)
    toks = np.repeat(np.arange(tokens), experts)
    weights = np.full(toks.size, 1.0 / experts, np.float32)
    times, start = [], 0
    for rep in range(reps + 1):
        rows = (start + np.tile(np.arange(experts), tokens)) % n
        start += experts
        t0 = time.perf_counter()
        cpu.moe_host(pool, x, rows, toks, weights, 0.0, isa)
        if rep:  # the first call starts the threads
            times.append(time.perf_counter() - t0)
    return experts * row_bytes(pool) / statistics.median(times) / 1e9


def reads_in_place_through_steps(steps: int = 3) -> str:
    """Whether CpuExperts reads a placed host pool in place, and still does after `steps`
    donating jitted steps that pass the pool through (as the engine's steps do)."""
    import jax

    from tidejax.residency.pool import host_pool

    pool = host_pool(random_pool("mxfp4", 4, 256, 128))
    experts = cpu.CpuExperts(pool, 4)
    before = experts.reads_in_place(pool)
    step = jax.jit(lambda pool, n: (pool, n + 1), donate_argnums=0)
    n = 0
    for _ in range(steps):
        pool, n = step(pool, n)
    kind = next(iter(pool.values())).sharding.memory_kind
    return f"{kind} pool read in place at boot: {before}, after {steps} donating steps: " \
           f"{experts.reads_in_place(pool)}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--intermediate", type=int, default=2304)
    parser.add_argument("--experts", default="1,3,6")
    parser.add_argument("--tokens", default="1,4,16")
    parser.add_argument("--formats", default="mxfp4,bf16")
    parser.add_argument("--isas", default="best", help="best, or all (every compiled path)")
    parser.add_argument("--pool", type=int, default=24, help="random experts in the pool")
    args = parser.parse_args(argv)
    isas = [cpu.kernel_isa()] if args.isas == "best" else [
        i for i in cpu.available_isas() if i != "numpy"]
    lines = [f"host kernel: best path {cpu.kernel_isa()}, {cpu.kernel_threads()} threads, "
             f"{os.cpu_count()} CPUs; {reads_in_place_through_steps()}", "",
             "| format | MB an expert | path | experts | tokens | ms | GB/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    print("\n".join(lines), flush=True)
    for fmt in args.formats.split(","):
        pool = random_pool(fmt, args.pool, args.hidden, args.intermediate)
        mb = row_bytes(pool) / 1e6
        for isa in isas:
            for experts in (int(e) for e in args.experts.split(",")):
                for tokens in (int(t) for t in args.tokens.split(",")):
                    gbps = host_gbps(pool, experts, tokens, isa)
                    ms = experts * row_bytes(pool) / gbps / 1e6
                    lines.append(f"| {fmt} | {mb:.1f} | {isa} | {experts} | {tokens} | {ms:.2f} | "
                                 f"{gbps:.1f} |")
                    print(lines[-1], flush=True)
        numpy_gbps = host_gbps(pool, 1, 1, "numpy", reps=3)
        lines.append(f"| {fmt} | {mb:.1f} | numpy | 1 | 1 | "
                     f"{row_bytes(pool) / numpy_gbps / 1e6:.2f} | {numpy_gbps:.1f} |")
        print(lines[-1], flush=True)
        del pool
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "cpu_experts.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
