"""GPU benchmark of the grouped MoE kernel and the demand counter (one call, one table).

DeepSeek-V4.1-Flash routed experts (hidden 5120, moe_intermediate 2304, 384 experts, 6 a token)
as MXFP4 and as bf16, at 1, 4, 16, 64 and 4096 tokens: time per call, effective GB/s of the
expert bytes read (each distinct expert once), the ratio to a device-to-device copy measured in
the same run, and at 4096 tokens TFLOP/s against a bf16 matmul measured in the same run. The
kernel is checked against the jnp reference on the GPU first. Prints a markdown table and
appends it to bench/RESULTS.md (and to $OUT/kernels.md when $OUT is set).

--variants instead times the kernel's variants (and the previous kernel, "v0") side by side at
each token count, with each one's error against the reference, and the jnp tile planning alone;
it prints one table (and writes $OUT/kernel_variants.md), RESULTS.md is left alone.

    PYTHONPATH=. python3 bench/kernels.py [--quick | --variants]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from tidejax.pallas.bank import bank_format
from tidejax.pallas.demand import count_demand_reference
from tidejax.pallas.demand_kernel import count_demand_pallas
from tidejax.pallas.moe import moe_grouped_reference
from tidejax.pallas import moe_kernel_v0
from tidejax.pallas.moe_kernel import TILES, default_variant, moe_grouped_pallas, plan_tiles, rows_per_tile

D, I, E, K = 5120, 2304, 384, 6
TOKENS = (1, 4, 16, 64, 4096)
ROTATE = 8  # routing sets cycled through, so that repeated calls do not hit in L2
# tiles tried where the targets are set (4 tokens, 4096 tokens); elsewhere TILES' choice
SWEEP = {
    4: [(16, 32, 256, 4, 4), (16, 32, 256, 4, 1), (16, 64, 128, 4, 1), (16, 32, 512, 4, 1), (16, 16, 256, 2, 1)],
    4096: [(64, 128, 64, 4, 4), (64, 128, 64, 4, 1), (64, 64, 128, 4, 2)],
}


def median_seconds(fn, *args, reps=7):
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def seconds_per_step(step, carry, *args, n_iter):
    """Median seconds of one `carry = step(carry, *args)`, from loops of n_iter inside one jit."""
    loop = jax.jit(lambda c, *a: jax.lax.fori_loop(0, n_iter, lambda j, c: step(j, c, *a), c))
    return median_seconds(loop, carry, *args, reps=5) / n_iter


def copy_gbps():
    a = jax.random.normal(jax.random.key(0), (256 * 1024 * 1024,), jnp.float32)  # 1 GiB
    s = seconds_per_step(lambda j, v: v + 1.0, a, n_iter=20)
    return 2 * a.nbytes / s / 1e9  # bytes read + written


def matmul_tflops():
    a = (jax.random.normal(jax.random.key(1), (8192, 8192), jnp.float32) / 8192**0.5).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    s = seconds_per_step(lambda j, c, p: p @ c, b, a, n_iter=10)  # c stays O(1): a is ~orthogonal
    return 2 * 8192**3 / s / 1e12


def make_bank(fmt, n, key):
    """Random bank of n slots (uint8 MXFP4 codes with scales near 2**-6, or bf16 N(0, 0.02))."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    if fmt == "mxfp4":
        bits = lambda k, shape: jax.random.bits(k, shape, jnp.uint8)
        scales = lambda k, shape: jax.random.randint(k, shape, 119, 123).astype(jnp.uint8)
        return {"gate_up_blocks": bits(k1, (n, 2 * I, D // 32, 16)),
                "gate_up_scales": scales(k2, (n, 2 * I, D // 32)),
                "down_blocks": bits(k3, (n, D, I // 32, 16)),
                "down_scales": scales(k4, (n, D, I // 32))}
    normal = jax.jit(lambda k, shape: (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(jnp.bfloat16),
                     static_argnums=1)
    return {"gate_up": jnp.concatenate([normal(jax.random.fold_in(k1, c), (16, 2 * I, D)) for c in range(n // 16)]),
            "down": jnp.concatenate([normal(jax.random.fold_in(k2, c), (16, D, I)) for c in range(n // 16)])}


def routing(rng, sets, t, n):
    """[sets, t, K] distinct slots a token (uniform), weights [t, K]."""
    ids = np.argsort(rng.random((sets, t, n)), axis=-1)[..., :K].astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(rng.random((t, K)).astype(np.float32))


def expert_bytes(bank):
    return sum(a.nbytes for a in bank.values()) // next(iter(bank.values())).shape[0]


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check(fmt, bank, rng):
    """Kernel vs reference on the GPU: decode tiles on the full bank, larger tiles on sub-banks."""
    errs = []
    for t, n in ((4, E), (64, min(64, E)), (1024, 32)):
        sub = jax.tree.map(lambda a: a[:n], bank) if n < E else bank
        ids, w = routing(rng, 1, t, n)
        ids = ids[0].at[0, 0].set(-1)  # one skipped pick
        x = jnp.asarray(rng.standard_normal((t, D)), jnp.bfloat16)
        got = moe_grouped_pallas(x, sub, ids, w, swiglu_limit=7.0)
        want = jax.jit(moe_grouped_reference, static_argnames="swiglu_limit")(
            x.astype(jnp.float32), sub, ids, w, swiglu_limit=7.0)
        errs.append(rel_err(got.astype(jnp.float32), want))
        print(f"check {fmt} tokens={t} slots={n}: rel err {errs[-1]:.2e}", flush=True)
    return max(errs)


def time_moe(bank, ids_sets, w, x, tile, kernel=moe_grouped_pallas, n_iter=None):
    """Seconds per call, from a loop of calls inside one jit (no dispatch gaps)."""
    def step(j, acc, x, bank, ids_sets, w):
        return acc + kernel(x, bank, ids_sets[j % ROTATE], w, tile=tile).astype(jnp.float32)
    return seconds_per_step(step, jnp.zeros(x.shape, jnp.float32), x, bank, ids_sets, w,
                            n_iter=n_iter or (200 if x.shape[0] <= 64 else 10))


def bench_format(fmt, rng, copy, mm, rows, quick):
    bank = make_bank(fmt, E, jax.random.key(3))
    per_expert = expert_bytes(bank)
    err = check(fmt, bank, rng)
    for t in TOKENS:
        ids_sets, w = routing(rng, ROTATE, t, E)
        x = jnp.asarray(rng.standard_normal((t, D)), jnp.bfloat16)
        distinct = np.mean([len(np.unique(np.asarray(s))) for s in ids_sets])
        tiles = [None] if quick else SWEEP.get(t, [None])
        results = []
        for tile in tiles:
            tile = tile or TILES[bank_format(bank)][rows_per_tile(t * K, E)]
            try:
                results.append((time_moe(bank, ids_sets, w, x, tile), tile))
                print(f"{fmt} tokens={t} tile={tile}: {results[-1][0] * 1e6:.1f} us", flush=True)
            except Exception:  # a tile that does not compile is reported, the sweep goes on
                print(f"{fmt} tokens={t} tile={tile} failed:\n{traceback.format_exc()}", flush=True)
        if not results:
            continue
        s, tile = min(results)
        gbps = distinct * per_expert / s / 1e9
        tflops = 2 * t * K * 3 * I * D / s / 1e12
        rows.append(f"| {fmt} | {t} | {distinct:.1f} | {'x'.join(map(str, tile))} | {s * 1e6:.1f} | "
                    f"{gbps:.0f} | {gbps / copy:.2f} | {tflops:.1f} | {tflops / mm:.2f} | {err:.1e} |")
        print(rows[-1], flush=True)


# --variants: (variant, tile) candidates per format and token count; "v0" = the previous kernel
# with its own tile choice. Tiles: rows x out-cols x K-block x warps x stages.
CANDIDATES = {
    "mxfp4": {
        1: [("v0", None), ("gemv", (1, 64, 128, 4, 1)), ("gemv-f32bits", (1, 64, 128, 4, 1))],
        4: [("v0", None), ("gemv", (1, 64, 128, 4, 1)), ("gemv", (1, 128, 128, 4, 1)),
            ("gemv", (1, 64, 256, 4, 1)), ("gemv", (1, 32, 128, 2, 1)), ("gemv-f32bits", (1, 64, 128, 4, 1)),
            ("dot-split", (16, 64, 128, 4, 1))],
        16: [("v0", None), ("gemv", (1, 64, 128, 4, 1)), ("gemv", (2, 64, 128, 4, 1))],
        64: [("v0", None), ("gemv", (1, 64, 128, 4, 1)), ("gemv", (2, 64, 128, 4, 1)),
             ("gemv", (4, 64, 128, 4, 1)), ("dot-split", (16, 64, 128, 4, 1))],
        4096: [("v0", None), ("dot", (64, 64, 128, 4, 2)), ("dot-split", (64, 64, 128, 4, 2))],
    },
    "bf16": {
        1: [("v0", None), ("gemv", (1, 64, 128, 4, 1))],
        4: [("v0", None), ("gemv", (1, 64, 128, 4, 1)), ("dot-split", (16, 32, 256, 4, 4))],
        64: [("v0", None), ("gemv", (2, 64, 128, 4, 1)), ("dot-split", (16, 32, 256, 4, 4))],
        4096: [("v0", None), ("dot-split", (64, 256, 64, 8, 3))],
    },
}


def kernel_of(variant, tile):
    """The kernel function of a candidate, taking (x, bank, ids, w, *, tile[, swiglu_limit])."""
    if variant == "v0":
        return moe_kernel_v0.moe_grouped_pallas
    return functools.partial(moe_grouped_pallas, variant=variant)


def variant_error(kernel, tile, bank, rng, t):
    """Relative error vs the reference at t tokens (full bank), or 1024 tokens on 32 slots; x of
    bf16 values given as float32, so that the output is float32 (not rounded to bf16)."""
    if t > 64:
        bank, t = jax.tree.map(lambda a: a[:32], bank), 1024
    n = next(iter(bank.values())).shape[0]
    ids, w = routing(rng, 1, t, n)
    ids = ids[0].at[0, 0].set(-1) if t > 1 else ids[0]
    x = jnp.asarray(rng.standard_normal((t, D)), jnp.bfloat16).astype(jnp.float32)  # float32 out
    got = kernel(x, bank, ids, w, tile=tile, swiglu_limit=7.0)
    want = jax.jit(moe_grouped_reference, static_argnames="swiglu_limit")(x, bank, ids, w, swiglu_limit=7.0)
    return rel_err(got, want)


def plan_seconds(t):
    """The jnp tile planning alone (sort of picks by slot) at t tokens, in a loop inside one jit."""
    ids = jnp.asarray(np.argsort(np.random.default_rng(0).random((ROTATE, t, E)), -1)[..., :K].astype(np.int32))
    bt = rows_per_tile(t * K, E)

    def step(j, acc, ids):
        tile_slot, row_token, pick_row = plan_tiles(ids[j % ROTATE], E, bt)
        return acc + tile_slot[0] + row_token[0] + pick_row[0]
    return seconds_per_step(step, jnp.int32(0), ids, n_iter=200)


def bench_variants(fmt, rng, copy, rows):
    bank = make_bank(fmt, E, jax.random.key(3))
    per_expert = expert_bytes(bank)
    for t, candidates in CANDIDATES[fmt].items():
        ids_sets, w = routing(rng, ROTATE, t, E)
        x = jnp.asarray(rng.standard_normal((t, D)), jnp.bfloat16)
        distinct = np.mean([len(np.unique(np.asarray(s))) for s in ids_sets])
        default = TILES[fmt if fmt == "mxfp4" else "dense"][rows_per_tile(t * K, E)]
        for variant, tile in candidates:
            kernel = kernel_of(variant, tile)
            try:
                s = time_moe(bank, ids_sets, w, x, tile, kernel=kernel, n_iter=50 if t <= 64 else 5)
                err = variant_error(kernel, tile, bank, rng, t)
            except Exception:  # a candidate that does not compile is reported, the sweep goes on
                print(f"{fmt} tokens={t} {variant} {tile} failed:\n{traceback.format_exc()}", flush=True)
                continue
            gbps = distinct * per_expert / s / 1e9
            mark = " (default)" if variant != "v0" and tile == default and variant == default_variant(tile[0]) else ""
            rows.append(f"| {fmt} | {t} | {distinct:.1f} | {variant}{mark} | {'x'.join(map(str, tile or ['own']))} | "
                        f"{s * 1e6:.1f} | {gbps:.0f} | {gbps / copy:.2f} | {err:.1e} |")
            print(rows[-1], flush=True)


def main_variants(args, copy):
    rows = []
    for fmt in args.formats.split(","):
        try:
            bench_variants(fmt, np.random.default_rng(int(time.time())), copy, rows)
        except Exception:
            print(f"{fmt} failed:\n{traceback.format_exc()}", flush=True)
    plans = [f"| plan_tiles | {t} | {plan_seconds(t) * 1e6:.1f} us |" for t in (1, 4, 64)]
    section = "\n".join([
        f"\n## Kernel variants ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)\n",
        f"`PYTHONPATH=. python3 bench/kernels.py {' '.join(sys.argv[1:])}` on {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}; device copy {copy:.0f} GB/s (read + write). v0 = the previous kernel. "
        "err = relative Frobenius error vs the float32 reference (swiglu_limit 7; 4096 tokens: checked at "
        "1024 tokens on 32 slots).\n",
        "| experts | tokens | distinct experts | variant | tile | us | GB/s | / copy | err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows, "",
        "| op | tokens | time |", "| --- | --- | --- |", *plans, "",
    ])
    print(section)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kernel_variants.md"), "w") as f:
            f.write(section)


def bench_demand(rng, rows):
    layers = 43
    for t in (64, 4096):
        ids = jnp.asarray(np.argsort(rng.random((t, E)), -1)[:, :K].astype(np.int32))
        w = jnp.asarray(rng.random((t, K)).astype(np.float32))
        mask = jnp.asarray(rng.random(t) > 0.1)
        c0 = jnp.zeros((layers, E), jnp.float32)
        ref = jax.jit(count_demand_reference)
        got, want = count_demand_pallas(c0, c0, 7, ids, w, mask), ref(c0, c0, 7, ids, w, mask)
        ok = bool(jnp.all(got[0] == want[0])) and rel_err(got[1], want[1]) < 1e-5
        s_k, s_r = (seconds_per_step(lambda j, c, *a: fn(c[0], c[1], j % layers, *a), (c0, c0), ids, w, mask,
                                     n_iter=100) for fn in (count_demand_pallas, count_demand_reference))
        rows.append(f"| count_demand | {t} | pallas {s_k * 1e6:.0f} us | XLA scatter-add {s_r * 1e6:.0f} us "
                    f"| {'equal' if ok else 'MISMATCH'} |")
        print(rows[-1], flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="no tile sweep")
    ap.add_argument("--formats", default="mxfp4,bf16", help="comma-separated: mxfp4, bf16")
    ap.add_argument("--no-demand", action="store_true", help="skip the demand counter rows")
    ap.add_argument("--variants", action="store_true", help="compare the kernel's variants (and v0)")
    args = ap.parse_args()
    rng = np.random.default_rng(int(time.time()))
    if args.variants:
        copy_gbps()  # warm the clocks up first
        return main_variants(args, copy_gbps())
    copy_gbps(), matmul_tflops()  # warm the clocks up first
    copy, mm = copy_gbps(), matmul_tflops()
    print(f"device copy {copy:.0f} GB/s (read + write), bf16 matmul {mm:.0f} TFLOP/s", flush=True)
    rows = []
    for fmt in args.formats.split(","):
        try:
            bench_format(fmt, rng, copy, mm, rows, args.quick)
        except Exception:
            print(f"{fmt} failed:\n{traceback.format_exc()}", flush=True)
    demand_rows = []
    try:
        if not args.no_demand:
            bench_demand(rng, demand_rows)
    except Exception:
        print(f"count_demand failed:\n{traceback.format_exc()}", flush=True)
    section = "\n".join([
        f"\n## Kernels: grouped MoE + demand counter ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)\n",
        f"`PYTHONPATH=. python3 bench/kernels.py {' '.join(sys.argv[1:])}` on {jax.devices()[0].device_kind}, jax {jax.__version__}. "
        f"Ceilings measured in the same run: device copy {copy:.0f} GB/s (read + write, 1 GiB f32), "
        f"bf16 matmul 8192^3 {mm:.0f} TFLOP/s. Experts: hidden {D}, moe_intermediate {I}, {E} in the bank, "
        f"{K} a token, random routing; GB/s counts each distinct expert's bytes once; "
        "tile = rows x cols x K-block x warps x stages (best of the sweep); err = max relative "
        "Frobenius error vs the jnp reference on the GPU (4 tokens full bank, 64 and 1024 tokens on sub-banks).\n",
        "| experts | tokens | distinct experts | tile | us | GB/s | / copy | TFLOP/s | / matmul | err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows, "",
        "| op | tokens | kernel | reference | check |",
        "| --- | --- | --- | --- | --- |",
        *demand_rows, "",
    ])
    print(section)
    with open(os.path.join(os.path.dirname(__file__), "RESULTS.md"), "a") as f:
        f.write(section)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kernels.md"), "w") as f:
            f.write(section)


if __name__ == "__main__":
    main()
