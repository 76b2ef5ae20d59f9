"""GPU benchmark of the grouped MoE kernel, without and with the demand counting fused in.

DeepSeek-V4.1-Flash routed experts (hidden 5120, moe_intermediate 2304, 384 experts, 6 a token;
a bank of fewer slots where 384 take more than a third of the device's memory limit: bank_slots)
as MXFP4 and as bf16, at 1, 4, 16, 64 and 4096 tokens: time per call, effective GB/s of the
expert bytes read (each distinct expert once), the ratio to the HBM read ceiling measured in
the same run, and at 4096 tokens TFLOP/s against a bf16 matmul measured in the same run. The
kernel is checked against the jnp reference on the GPU first, plain and with gpt-oss's expert
biases and activation (tidejax.contract). Then the MXFP4 kernel at 4 and 64
tokens without and with `demand` (the residency counters counted inside it), its counts checked
against `count_demand_reference`. Prints markdown tables and appends them to bench/RESULTS.md
(and to $OUT/kernels.md when $OUT is set).

--prefill instead times a prompt chunk's grouped MoE (PREFILL_TOKENS tokens) at DeepSeek-V3's
(7168, 2048) and V4.1-Flash's (5120, 2304) expert shapes, both formats: the Pallas dots path
(its own tile choice) beside the Triton grouped GEMM (tidejax.pallas.moe_prefill, its untuned
tiles; with --prefill-tiles each of PREFILL_TILES), ms, TFLOP/s and the ratio to the bf16
matmul of the same run (its table in $OUT/kernels_prefill.md). Each is checked against the
reference on the GPU first, on a bank of the check's slots alone (the full bank is made after),
and each compiled call's argument and temporary GiB are printed before it runs (the check's
call and the timed loop, each compiled once).

    python3 -m bench.kernels [--quick] [--formats mxfp4,bf16] [--no-demand]
    python3 -m bench.kernels --prefill [--prefill-tiles] [--formats mxfp4,bf16]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import copy_gbps, hbm_read_gbps, matmul_tflops, seconds_per_step
from tidejax.contract import bank_format
from tidejax.pallas.bank import bank_dims
from tidejax.pallas.demand import Demand, count_demand_reference
from tidejax.pallas.moe import moe_grouped_reference
from tidejax.pallas.moe_kernel import choose_tile, moe_grouped_pallas
from tidejax.pallas.moe_prefill import moe_grouped_triton

D, I, E, K = 5120, 2304, 384, 6
CHECK_SLOTS = 96  # the check's largest sub-bank (GEMV at 4 tokens)
TOKENS = (1, 4, 16, 64, 4096)
ROTATE = 8  # routing sets cycled through, so that repeated calls do not hit in L2
LAYERS = 40  # layers of the demand counters (DeepSeek-V4.1-Flash has 40)
# tiles tried at each token count (the best is reported); elsewhere choose_tile's
SWEEP = {  # GEMV tiles (bt = 1) at 1-64 tokens, dot tiles at 64 and 4096 (128-row ones too)
    1: [(1, 32, 256, 4, 1), (1, 64, 128, 4, 1), (1, 16, 256, 2, 1)],
    4: [(1, 32, 256, 4, 1), (1, 64, 128, 4, 1), (1, 16, 256, 2, 1), (1, 32, 512, 4, 1)],
    16: [(1, 32, 256, 4, 1), (1, 64, 128, 4, 1), (1, 16, 256, 2, 1)],
    64: [(1, 32, 256, 4, 1), (16, 64, 128, 4, 1), (16, 32, 256, 4, 4)],
    4096: [(64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (64, 64, 128, 4, 2),
           (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3)],
}
# --prefill: expert shapes (hidden, moe_intermediate, experts, picks a token) at PREFILL_TOKENS
PREFILL_SHAPES = {"V3": (7168, 2048, 256, 8), "V4.1-Flash": (5120, 2304, 384, 6)}
PREFILL_TOKENS = 4096
PREFILL_CHECK = (1024, 32)  # tokens, slots of the check against the reference
# --prefill-tiles: the Triton kernel's (BM, BN, BK, num_warps, num_stages) tried, the module's
# first; each compiles for sm_90 in both formats (tests/pallas/test_moe_prefill.py). The
# accumulators are [BN, BM] float32, two of them in gate_up's pass: 128 x 128 needs 8 warps.
PREFILL_TILES = [(64, 128, 64, 4, 3), (64, 128, 64, 8, 3), (64, 128, 128, 8, 3),
                 (64, 256, 64, 8, 3), (64, 64, 128, 4, 4), (128, 128, 64, 8, 3),
                 (128, 128, 64, 8, 4), (128, 64, 128, 4, 3)]


def make_bank(fmt, n, key, d=D, i=I):
    """Random bank of n slots (a multiple of 16), hidden d, intermediate i (uint8 MXFP4 codes
    with scales near 2**-6, or bf16 N(0, 0.02))."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    if fmt == "mxfp4":
        bits = lambda k, shape: jax.random.bits(k, shape, jnp.uint8)
        scales = lambda k, shape: jax.random.randint(k, shape, 119, 123).astype(jnp.uint8)
        return {"gate_up_blocks": bits(k1, (n, 2 * i, d // 32, 16)),
                "gate_up_scales": scales(k2, (n, 2 * i, d // 32)),
                "down_blocks": bits(k3, (n, d, i // 32, 16)),
                "down_scales": scales(k4, (n, d, i // 32))}
    return {"gate_up": _normal_bf16(k1, (n, 2 * i, d)), "down": _normal_bf16(k2, (n, d, i))}


@functools.partial(jax.jit, static_argnums=1)
def _normal_bf16(key, shape):
    """N(0, 0.02) as bf16 [n, ...], drawn 16 slots at a time into the one array: no float32
    copy of the whole, and no chunks beside it (a concatenation held the bank twice)."""
    draw = lambda c: (jax.random.normal(jax.random.fold_in(key, c), (16, *shape[1:]), jnp.float32)
                      * 0.02).astype(jnp.bfloat16)
    return jax.lax.map(draw, jnp.arange(shape[0] // 16)).reshape(shape)


def bank_slots(fmt) -> int:
    """The slots of the bank timed in `fmt`: E, or, where the device reports its memory limit
    (memory_stats' bytes_limit) and E slots take more than a third of it, as many as do (a
    multiple of 16, at least the check's 96): beside the bank the check holds copies of up to 96
    of its slots and the reference's rows. An H200 keeps 384 bf16 slots, an H100 fewer."""
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    per_slot = sum(math.prod(a.shape[1:]) * a.dtype.itemsize for a in jax.eval_shape(
        lambda: make_bank(fmt, 16, jax.random.key(0))).values())
    if limit is None or E * per_slot <= limit / 3:
        return E
    return max(CHECK_SLOTS, int(limit / 3 / per_slot) // 16 * 16)


def routing(rng, sets, t, n, k=K):
    """[sets, t, k] distinct slots a token (uniform), weights [t, k]."""
    ids = np.argsort(rng.random((sets, t, n)), axis=-1)[..., :k].astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(rng.random((t, k)).astype(np.float32))


def expert_bytes(bank):
    return sum(a.nbytes for a in bank.values()) // next(iter(bank.values())).shape[0]


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# the activation's forms checked: the clamped silu(g) * u, and gpt-oss's (with its bias leaves)
PLAIN = dict(swiglu_limit=7.0)
GPT_OSS = dict(swiglu_limit=7.0, swiglu_alpha=1.702, swiglu_up_shift=1.0)


def with_biases(bank, rng):
    """The bank with gpt-oss's bias leaves (tidejax.contract): bf16, N(0, 0.02) as the weights."""
    n, d, i = bank_dims(bank)
    bias = lambda shape: jnp.asarray(rng.standard_normal(shape) * 0.02, jnp.bfloat16)
    return {**bank, "gate_up_bias": bias((n, 2 * i)), "down_bias": bias((n, d))}


def check(fmt, bank, rng):
    """Kernel vs reference on the GPU, {"gemv": err, "dots": err} (the worse of the plain form
    and gpt-oss's): 4 tokens on 96 slots (GEMV), 64 and 1024 tokens on 64 and 32 (dots).
    Sub-banks, because the reference dequantizes every slot it is given (the full bank's 384 do
    not fit an H100's 80 GB). x holds bf16 values as float32, so that the output is float32 (not
    rounded to bf16)."""
    errs = {}
    for t, n in ((4, CHECK_SLOTS), (64, 64), (1024, 32)):
        path = "gemv" if choose_tile(bank_format(bank), t * K, n)[0] == 1 else "dots"
        err = kernel_err(moe_grouped_pallas, bank, rng, t, n, K, f"{fmt} ({path})")
        errs[path] = max(errs.get(path, 0.0), err)
    return errs


def kernel_err(kernel, bank, rng, t, n, k, label):
    """The worse relative error of kernel(x, bank, ids, w, **form) against the jnp reference on
    the GPU, plain and gpt-oss's, for t tokens x k picks on the bank's first n slots (one pick
    skipped)."""
    reference = jax.jit(moe_grouped_reference,
                        static_argnames=("swiglu_limit", "swiglu_alpha", "swiglu_up_shift"))
    sub = jax.tree.map(lambda a: a[:n], bank)
    ids, w = routing(rng, 1, t, n, k)
    ids = ids[0].at[0, 0].set(-1)  # one skipped pick
    x = jnp.asarray(rng.standard_normal((t, bank_dims(bank)[1])), jnp.bfloat16).astype(jnp.float32)
    worst = 0.0
    for name, form, checked in (("plain", PLAIN, sub), ("gpt-oss", GPT_OSS, with_biases(sub, rng))):
        call = jax.jit(functools.partial(kernel, **form)).lower(x, checked, ids, w).compile()
        print(f"check {label} {name}: {executable_gib(call)}", flush=True)
        err = rel_err(call(x, checked, ids, w), reference(x, checked, ids, w, **form))
        worst = max(worst, err)
        print(f"check {label} {name} tokens={t} slots={n}: rel err {err:.2e}", flush=True)
    return worst


def executable_gib(compiled) -> str:
    """A compiled call's arguments' and temporaries' GiB (XLA's memory analysis)."""
    m = compiled.memory_analysis()
    return (f"arguments {m.argument_size_in_bytes / 2**30:.2f} GiB, "
            f"temporaries {m.temp_size_in_bytes / 2**30:.2f} GiB")


def time_moe(bank, ids_sets, w, x, tile, mask=None, kernel=moe_grouped_pallas, label=None):
    """Seconds per call of kernel(x, bank, ids, w) (moe_grouped_pallas given `tile`; None: the
    kernel's own choice), from a loop of calls inside one jit (no dispatch gaps); with a token
    mask, each call also counts its picks into [LAYERS, slots] demand counters (layer
    j % LAYERS). With a `label`, the compiled loop's GiB are printed under it before it runs."""
    if tile is not None:
        kernel = functools.partial(kernel, tile=tile)

    def step(j, carry, x, bank, ids_sets, w, mask):
        acc, counters = carry
        ids = ids_sets[j % ROTATE]
        if mask is None:
            return acc + kernel(x, bank, ids, w).astype(jnp.float32), counters
        demand = Demand(*counters, j % LAYERS, ids, w, mask)
        y, *counters = kernel(x, bank, ids, w, demand=demand)
        return acc + y.astype(jnp.float32), tuple(counters)
    counters = (jnp.zeros((LAYERS, bank_dims(bank)[0]), jnp.float32),) * 2
    report = (lambda loop: print(f"{label}: {executable_gib(loop)}", flush=True)) if label else None
    return seconds_per_step(step, (jnp.zeros(x.shape, jnp.float32), counters), x, bank, ids_sets, w, mask,
                            n_iter=200 if x.shape[0] <= 64 else 10, on_compile=report)


def bench_format(fmt, rng, read, mm, rows, quick):
    """Appends the format's rows; returns its bank (bank_slots(fmt) slots)."""
    n = bank_slots(fmt)
    bank = make_bank(fmt, n, jax.random.key(3))
    per_expert = expert_bytes(bank)
    errs = check(fmt, bank, rng)
    for t in TOKENS:
        ids_sets, w = routing(rng, ROTATE, t, n)
        x = jnp.asarray(rng.standard_normal((t, D)), jnp.bfloat16)
        distinct = np.mean([len(np.unique(np.asarray(s))) for s in ids_sets])
        tiles = [None] if quick else SWEEP.get(t, [None])
        results = []
        for tile in tiles:
            tile = tile or choose_tile(bank_format(bank), t * K, n)
            try:
                results.append((time_moe(bank, ids_sets, w, x, tile), tile))
                print(f"{fmt} tokens={t} tile={tile}: {results[-1][0] * 1e6:.1f} us", flush=True)
            except Exception:  # a tile that does not compile is reported, the sweep goes on
                print(f"{fmt} tokens={t} tile={tile} failed:\n{traceback.format_exc()}", flush=True)
        if not results:
            continue
        s, tile = min(results)
        err = errs["gemv" if tile[0] == 1 else "dots"]
        gbps = distinct * per_expert / s / 1e9
        tflops = 2 * t * K * 3 * I * D / s / 1e12
        rows.append(f"| {fmt}, {n} slots | {t} | {distinct:.1f} | {'x'.join(map(str, tile))} | {s * 1e6:.1f} | "
                    f"{gbps:.0f} | {gbps / read:.2f} | {tflops:.1f} | {tflops / mm:.2f} | {err:.1e} |")
        print(rows[-1], flush=True)
    return bank


def bench_demand(bank, rng, rows):
    """The kernel without and with the demand counting at 4 and 64 tokens (its own tile choice),
    a tenth of the tokens padding; check: its counts against `count_demand_reference`."""
    n = bank_dims(bank)[0]
    for t in (4, 64):
        ids_sets, w = routing(rng, ROTATE, t, n)
        x = jnp.asarray(rng.standard_normal((t, D)), jnp.bfloat16)
        mask = jnp.asarray(rng.random(t) > 0.1)
        counters = jnp.asarray(rng.integers(0, 9, (LAYERS, n)), jnp.float32)
        demand = Demand(counters, counters, 7, ids_sets[0], w, mask)
        _, counts, sums = moe_grouped_pallas(x, bank, ids_sets[0], w, demand=demand)
        want = jax.jit(count_demand_reference)(*demand)
        ok = bool(jnp.all(counts == want[0])) and rel_err(sums, want[1]) < 1e-6
        without, with_demand = (time_moe(bank, ids_sets, w, x, None, m) for m in (None, mask))
        rows.append(f"| moe_grouped {bank_format(bank)}, {n} slots | {t} | {without * 1e6:.1f} us | "
                    f"{with_demand * 1e6:.1f} us | {'equal' if ok else 'MISMATCH'} |")
        print(rows[-1], flush=True)


def bench_prefill(rng, mm, formats, rows, tiles):
    """A prompt chunk's grouped MoE at PREFILL_TOKENS tokens for each of PREFILL_SHAPES and
    formats: the Pallas dots path (its own tile) and the Triton grouped GEMM at each of `tiles`
    (None: its own), each checked against the reference on the GPU first (PREFILL_CHECK) on a
    bank of those slots alone, then timed on the full bank; appends table rows."""
    t = PREFILL_TOKENS
    kernels = {"pallas dots": moe_grouped_pallas}
    for tile in tiles:
        name = "triton" if tile is None else f"triton {'x'.join(map(str, tile))}"
        kernels[name] = functools.partial(moe_grouped_triton, tile=tile)
    for shape, (d, i, e, k) in PREFILL_SHAPES.items():
        for fmt in formats:
            check_bank = make_bank(fmt, PREFILL_CHECK[1], jax.random.key(5), d, i)
            errs = {}
            for name, kernel in kernels.items():
                try:
                    errs[name] = kernel_err(kernel, check_bank, rng, *PREFILL_CHECK, k,
                                            f"{shape} {fmt} {name}")
                except Exception:  # a kernel that fails is reported, the others go on
                    print(f"{shape} {fmt} {name} failed:\n{traceback.format_exc()}", flush=True)
            del check_bank
            bank = make_bank(fmt, e, jax.random.key(5), d, i)
            ids_sets, w = routing(rng, ROTATE, t, e, k)
            x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
            for name, err in errs.items():
                try:
                    s = time_moe(bank, ids_sets, w, x, None, kernel=kernels[name],
                                 label=f"{shape} {fmt} {name} at {t} tokens (its timed loop)")
                except Exception:
                    print(f"{shape} {fmt} {name} failed:\n{traceback.format_exc()}", flush=True)
                    continue
                tflops = 2 * t * k * 3 * i * d / s / 1e12
                rows.append(f"| {shape} ({d}, {i}) | {fmt} | {name} | {s * 1e3:.2f} | "
                            f"{tflops:.1f} | {tflops / mm:.2f} | {err:.1e} |")
                print(rows[-1], flush=True)
            del bank


def prefill_section(mm, rows) -> str:
    return "\n".join([
        f"\n## Kernels: a prompt chunk's grouped MoE, Pallas dots and Triton ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)\n",
        f"`python3 -m bench.kernels {' '.join(sys.argv[1:])}` on {jax.devices()[0].device_kind}, jax {jax.__version__}. "
        f"{PREFILL_TOKENS} tokens, random routing, bf16 x; bf16 matmul 8192^3 {mm:.0f} TFLOP/s in the same run. "
        "pallas dots: tidejax.pallas.moe_kernel, its own tile; triton: tidejax.pallas.moe_prefill, its untuned "
        "tiles (triton BMxBNxBKxwarpsxstages: that tile). TFLOP/s counts the three projections of every pick; "
        f"err = max relative Frobenius error vs the jnp reference on the GPU ({PREFILL_CHECK[0]} tokens on "
        f"{PREFILL_CHECK[1]} slots, plain and gpt-oss's).\n",
        "| experts (hidden, intermediate) | format | kernel | ms | TFLOP/s | / matmul | err |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows, "",
    ])


def write_section(section, out_name):
    """Prints a results section and appends it to bench/RESULTS.md (and $OUT/out_name)."""
    print(section)
    with open(os.path.join(os.path.dirname(__file__), "RESULTS.md"), "a") as f:
        f.write(section)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], out_name), "w") as f:
            f.write(section)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="no tile sweep")
    ap.add_argument("--formats", default="mxfp4,bf16", help="comma-separated: mxfp4, bf16")
    ap.add_argument("--no-demand", action="store_true", help="skip the demand counting rows (MXFP4)")
    ap.add_argument("--prefill", action="store_true",
                    help="only the prompt chunk's table: Pallas dots and Triton at 4096 tokens")
    ap.add_argument("--prefill-tiles", action="store_true",
                    help="with --prefill: the Triton kernel at each of PREFILL_TILES")
    args = ap.parse_args()
    if args.prefill_tiles and not args.prefill:
        ap.error("--prefill-tiles goes with --prefill")
    rng = np.random.default_rng(int(time.time()))
    hbm_read_gbps(), matmul_tflops()  # warm the clocks up first
    read, copy, mm = hbm_read_gbps(), copy_gbps(), matmul_tflops()
    print(f"HBM read {read:.0f} GB/s, device copy {copy:.0f} GB/s (read + write), bf16 matmul "
          f"{mm:.0f} TFLOP/s", flush=True)
    if args.prefill:
        rows = []
        bench_prefill(rng, mm, args.formats.split(","), rows,
                      PREFILL_TILES if args.prefill_tiles else [None])
        write_section(prefill_section(mm, rows), "kernels_prefill.md")
        return
    rows, demand_rows = [], []
    for fmt in args.formats.split(","):
        try:
            bank = bench_format(fmt, rng, read, mm, rows, args.quick)
        except Exception:
            print(f"{fmt} failed:\n{traceback.format_exc()}", flush=True)
            continue
        try:
            if fmt == "mxfp4" and not args.no_demand:
                bench_demand(bank, rng, demand_rows)
        except Exception:
            print(f"demand counting failed:\n{traceback.format_exc()}", flush=True)
        del bank  # freed before the next format's is made
    section = "\n".join([
        f"\n## Kernels: grouped MoE, without and with demand counting ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)\n",
        f"`python3 -m bench.kernels {' '.join(sys.argv[1:])}` on {jax.devices()[0].device_kind}, jax {jax.__version__}. "
        f"Ceilings measured in the same run: HBM read {read:.0f} GB/s (bench/ceilings.py, the GB/s "
        f"ratio's divisor), device copy {copy:.0f} GB/s (read + write, 1 GiB f32), "
        f"bf16 matmul 8192^3 {mm:.0f} TFLOP/s. Experts: hidden {D}, moe_intermediate {I}, {E} in the bank "
        "(fewer where a third of the device's memory limit holds fewer: bank_slots; the experts column), "
        f"{K} a token, random routing; GB/s counts each distinct expert's bytes once; "
        "tile = rows x cols x K-block x warps x stages (best of the sweep; rows 1 = the GEMV path); err = "
        f"max relative Frobenius error of that path vs the jnp reference on the GPU (GEMV: 4 tokens on {CHECK_SLOTS} "
        "slots; dots: 64 and 1024 tokens on 64 and 32).\n",
        "| experts | tokens | distinct experts | tile | us | GB/s | / read | TFLOP/s | / matmul | err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows, "",
        f"Demand counting fused into the kernel (MXFP4, own tile choice, counters [{LAYERS}, slots], a tenth "
        "of the tokens padding): us a call without / with it; check = counts equal "
        "count_demand_reference's, weight sums within 1e-6.\n",
        "| op | tokens | without | with | check |",
        "| --- | --- | --- | --- | --- |",
        *demand_rows, "",
    ])
    write_section(section, "kernels.md")


if __name__ == "__main__":
    main()
