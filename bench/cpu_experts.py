"""The `cpu` miss policy's host kernel (tidejax.residency.cpu.moe_host) on this machine's CPU:
GB/s of expert bytes (MXFP4 codes and scales, or bf16 values) a layer's missed picks stream,
over distinct experts x tokens a step, per ISA path.

    python3 -m bench.cpu_experts [--hidden 5120] [--intermediate 2304] [--experts 1,3,6]
        [--tokens 1,4,16] [--formats mxfp4,bf16] [--isas best|all] [--pool 24] [--calls-only]

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


from tidejax.pallas.bank import bank_dims
from tidejax.residency import cpu
from tidejax.residency.pool import row_bytes


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


def call_cost(layers: int = 40, picks: int = 1, d: int = 5120, inter: int = 2304,
              reps: int = 5) -> list[str]:
    """The host kernel called from a jitted chain of `layers` dependent calls on the default
    device (one a MoE layer, each reading the previous layer's output), through the custom call
    and through jax.pure_callback: ms a call and the largest difference from moe_host."""
    import jax
    import jax.numpy as jnp

    from tidejax.residency.pool import host_pool

    pool = host_pool(random_pool("mxfp4", layers, d, inter))
    r = np.random.default_rng(2)
    x = jnp.asarray(r.standard_normal((1, d), np.float32))
    ids = jnp.asarray(r.integers(0, 1, (1, max(picks, 1))), jnp.int32)
    weights = jnp.full(ids.shape, 0.5, jnp.float32)
    miss = jnp.arange(ids.shape[1])[None] < picks
    lines = []
    for via in ("custom_call", "callback"):
        experts = cpu.CpuExperts(pool, 1, via=via)

        def chain(x, ids, weights, miss):
            outs = []
            for layer in range(layers):
                y = experts.serve(layer, x, ids, weights, miss, 0.0)
                outs.append(y)
                x = x + 1e-3 * y
            return jnp.stack(outs)

        run = jax.jit(chain)
        ys = np.asarray(run(x, ids, weights, miss))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run(x, ids, weights, miss).block_until_ready()
            times.append(time.perf_counter() - t0)
        views = experts.views
        xs = np.asarray(x)
        err = 0.0
        for layer in range(layers):  # the same chain on the host
            t, k = np.nonzero(np.asarray(miss))
            want = cpu.moe_host(views, xs, layer + np.asarray(ids)[t, k], t,
                                np.asarray(weights)[t, k])
            err = max(err, float(np.abs(ys[layer] - want).max() / (np.abs(want).max() + 1e-30)))
            xs = xs + 1e-3 * want
        how = (f"custom call on {experts.platform}" if experts.handle is not None
               else "pure_callback")
        ms = statistics.median(times) / layers * 1e3
        lines.append(f"| {how} | {layers} | {picks} | {ms:.3f} | {err:.1e} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--intermediate", type=int, default=2304)
    parser.add_argument("--experts", default="1,3,6")
    parser.add_argument("--tokens", default="1,4,16")
    parser.add_argument("--formats", default="mxfp4,bf16")
    parser.add_argument("--isas", default="best", help="best, or all (every compiled path)")
    parser.add_argument("--pool", type=int, default=24, help="random experts in the pool")
    parser.add_argument("--calls-only", action="store_true",
                        help="only the table of a call's cost from inside a jit")
    args = parser.parse_args(argv)
    calls = ["", f"Called from a jit on {jax_backend()} ({args.hidden} x {args.intermediate}, one "
             "token): ms a call, relative difference from moe_host", "",
             "| call | layers | picks | ms a call | difference |",
             "| --- | --- | --- | --- | --- |"]
    for picks in (0, 1):
        calls += call_cost(picks=picks, d=args.hidden, inter=args.intermediate)
        print("\n".join(calls), flush=True)
    if args.calls_only:
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "cpu_experts.md").write_text("\n".join(calls) + "\n")
        return 0
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
        Path(os.environ["OUT"], "cpu_experts.md").write_text("\n".join(lines + calls) + "\n")
    return 0


def jax_backend() -> str:
    import jax
    return f"{jax.default_backend()} ({jax.devices()[0].device_kind})"


if __name__ == "__main__":
    sys.exit(main())
