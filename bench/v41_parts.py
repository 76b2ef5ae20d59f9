"""Two parts of the DeepSeek-V4.1 step that launch many small kernels (the 40-layer profile in
RESULTS.md, 2026-12-04), each timed alone on the device in its reference form beside candidates:

- mHC's Sinkhorn, `--sites` of them chained in one jit as a step has them (two a layer): the
  jnp reference (pallas.sinkhorn.sinkhorn_reference, a loop of row and column sums over
  [..., hc, hc]), that loop unrolled, a loop whose body is elementwise over the hc * hc entries
  held as separate [...] arrays (one fusion an iteration, no reductions), and the Triton kernel
  (ops.sinkhorn's kernel through jax-triton; Triton's interpreter off the GPU). The whole iteration chain elementwise
  without a loop would fuse into one kernel, but XLA takes 23 s to compile one site of it on the
  CPU (jax 0.10.2), 91 s for 8: not a candidate.
- mHC's front half, `--sites` of them chained in one jit (streams [tokens, 4, 4096] bf16, fn
  [24, 16384]): the pre, post, comb and collapsed input of ops.mhc_front, as the jnp reference
  (its Sinkhorn too), as the model ran it before the fused form (the reference with ops.sinkhorn's
  Triton kernel) and as the two fused Triton kernels (pallas.mhc). Each site collapses by the
  last site's pre and feeds its outputs to the next site's streams by one elementwise op, the
  same for every form (V4.1's data flow, hc_expand's matmul left out). Off the GPU the fused
  form runs in Triton's interpreter, ~10 s a site at one token, and the profiler's trace of
  its Python calls ran out of 24 GB on the CPU: time it on a GPU.
- The Engram rows (models/deepseek_v41/engram.gather_rows): the decode step's loop, one row of
  every table an iteration from host memory; and the rows gathered on the host with numpy from
  the same tables' bytes (parallel.host_buffer), copied to the device and dequantized there, as
  a prompt chunk's step now takes them (engram.prompt_rows).

    python -m bench.v41_parts [--tokens 1,4,2048] [--iters 20] [--sites 80] [--rows 4070432]
        [--forms reference,unrolled,elementwise,triton] [--mhc-forms reference,chain,fused]
        [--parts sinkhorn,mhc,engram]

Per part and token count: seconds the first call took (compiling), ms a call (median of --reps,
back to back, waited for), kernels a call (op executions in a profiler trace of one call) and the
candidate's largest difference from the reference form's output. On the CPU (jax 0.10.2) the 80
Sinkhorn sites compile in 1.3 s as a loop, 6.3 s with an elementwise body, 25 s unrolled: a step
compiles them for each of its shapes.
"""

from __future__ import annotations

import argparse
import functools
import operator
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


from bench.profile_step import trace_events
from tidejax import parallel
from tidejax.models.deepseek_v41.engram import EngramTables, dequantized, gather_rows
from tidejax import ops
from tidejax.pallas.mhc import mhc_front_reference
from tidejax.pallas.sinkhorn import sinkhorn_reference

ENGRAM_LAYERS, COLS, WIDTH = 2, 24, 256  # ds41-flash: 2 Engram layers, (4 - 1) x 8 heads, 256
HC, HIDDEN = 4, 4096  # ds41-flash's hc_mult and hidden_size
PARTS = ("sinkhorn", "mhc", "engram")


def timed(fn, *args, reps: int) -> tuple[float, float, object]:
    """(seconds the first call took (compiling), median ms a call, kernels a call, the output)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            jax.block_until_ready(fn(*args))
        kernels = len(trace_events(Path(folder)))
    return first, statistics.median(times), kernels, out


def unrolled_sinkhorn(logits, *, hc_eps: float, iters: int):
    """sinkhorn_reference's iterations inlined."""
    comb = jax.nn.softmax(logits, -1) + hc_eps
    comb = comb / (jnp.sum(comb, -2, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (jnp.sum(comb, -1, keepdims=True) + hc_eps)
        comb = comb / (jnp.sum(comb, -2, keepdims=True) + hc_eps)
    return comb


def elementwise_sinkhorn(logits, *, hc_eps: float, iters: int):
    """sinkhorn_reference's loop over the hc * hc entries as separate [...] arrays: the sums are adds of
    arrays on one index, so each iteration's body is elementwise."""
    hc = logits.shape[-1]

    def total(values):
        return functools.reduce(operator.add, values)

    def normalized(c):
        c = [[x / (total(row) + hc_eps) for x in row] for row in c]
        columns = [total(row[k] for row in c) + hc_eps for k in range(hc)]
        return [[x / s for x, s in zip(row, columns)] for row in c]

    comb = jax.nn.softmax(logits, -1) + hc_eps
    comb = comb / (jnp.sum(comb, -2, keepdims=True) + hc_eps)
    entries = [[comb[..., j, k] for k in range(hc)] for j in range(hc)]
    entries = jax.lax.fori_loop(0, iters - 1, lambda _, c: normalized(c), entries)
    return jnp.stack([jnp.stack(row, -1) for row in entries], -2)


SINKHORN_FORMS = {"reference": ("loop (reference)", sinkhorn_reference),
                  "unrolled": ("loop unrolled", unrolled_sinkhorn),
                  "elementwise": ("elementwise loop body", elementwise_sinkhorn),
                  "triton": ("triton kernel", functools.partial(ops.sinkhorn, impl="pallas"))}


def chained_sinkhorn(form, sites: int, iters: int):
    @jax.jit
    def run(logits):
        comb = jnp.zeros_like(logits)
        for _ in range(sites):  # each site's input depends on the last one's output, as in a step
            comb = form(logits + 1e-3 * comb, hc_eps=1e-6, iters=iters)
        return comb
    return run


MHC_FORMS = {"reference": ("jnp reference", functools.partial(ops.mhc_front, impl="reference")),
             "chain": ("jnp + sinkhorn kernel", functools.partial(
                 mhc_front_reference, sinkhorn=functools.partial(ops.sinkhorn, impl="pallas"))),
             "fused": ("fused triton kernels", functools.partial(ops.mhc_front, impl="pallas"))}


def chained_mhc_front(form, sites: int, iters: int):
    @jax.jit
    def run(streams, fn, base, scale):
        pre = jnp.zeros(streams.shape[:-1], jnp.float32).at[..., 0].set(1.0)
        for _ in range(sites):  # each site's input depends on the last one's outputs
            pre, post, comb, x = form(streams, fn, base, scale, pre, eps=1e-6, hc_eps=1e-6,
                                      iters=iters)
            mixed = x[..., None, :] + (post + jnp.sum(comb, -2))[..., None]
            streams = (streams + 1e-3 * mixed).astype(streams.dtype)
        return streams.astype(jnp.float32)
    return run


def mhc_site(tokens: int, rng):
    """Random streams [tokens, HC, HIDDEN] bf16 and one site's (fn, base, scale)."""
    outputs = (2 + HC) * HC
    return (jnp.asarray(rng.normal(size=(tokens, HC, HIDDEN)), jnp.bfloat16),
            jnp.asarray(rng.normal(0, 0.02, (outputs, HC * HIDDEN)), jnp.float32),
            jnp.asarray(rng.normal(size=(outputs,)), jnp.float32),
            jnp.asarray(rng.uniform(0.5, 2, (3,)), jnp.float32))


def engram_tables(rows: int, rng) -> EngramTables:
    """Random e4m3 tables [rows, WIDTH] with float32 scales per 32 channels, in host memory; the
    hashing fields, which gather_rows does not read, empty."""
    tables = []
    for _ in range(ENGRAM_LAYERS):
        values = rng.integers(0, 126, (rows, WIDTH), dtype=np.uint8).view(jnp.float8_e4m3fn)
        scales = rng.uniform(0.5, 2.0, (rows, WIDTH // 32)).astype(np.float32)
        tables.append({"values": values, "scales": scales})
    axes = jax.tree.map(lambda _: (None, None), tables)
    empty = jnp.zeros((0,), jnp.int32)
    return EngramTables(empty, empty, empty, empty, empty,
                        tuple(parallel.put(tables, axes, memory="host")), 0)


def host_gathered(eng: EngramTables, views: list, ids: np.ndarray):
    """The rows `ids` [b, t, layers, cols] name, read on the host and copied to the device."""
    b, t, _, c = ids.shape
    flat = ids.transpose(2, 0, 1, 3).reshape(ENGRAM_LAYERS, -1)
    got = tuple({name: jax.device_put(view[name][flat[layer]]) for name in view}
                for layer, view in enumerate(views))
    return _dequantize(got, (b, t, c))


_dequantize = jax.jit(dequantized, static_argnums=1)


def time_forms(table: list, part: str, tokens: int, named: list, inputs: tuple, reps: int):
    """Times each (label, jitted fn) of `named` on `inputs`, a row of `table` each, printed; the
    difference from the first one's output."""
    reference = None
    for label, fn in named:
        compile_s, ms, kernels, out = timed(fn, *inputs, reps=reps)
        reference = out if reference is None else reference
        diff = float(jnp.max(jnp.abs(out - reference)))
        table.append(f"| {part} | {tokens} | {label} | {compile_s:.2f} | {ms:.3f} | {kernels} | "
                     f"{diff:.1e} |")
        print(table[-1], flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,4,2048", help="tokens a call, comma-separated")
    parser.add_argument("--iters", type=int, default=20, help="hc_sinkhorn_iters")
    parser.add_argument("--sites", type=int, default=80, help="Sinkhorn sites a step")
    parser.add_argument("--rows", type=int, default=4_070_432, help="rows of each Engram table")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--forms", default=",".join(SINKHORN_FORMS),
                        help="Sinkhorn forms, comma-separated, the first the one the others are "
                             f"checked against (of {', '.join(SINKHORN_FORMS)})")
    parser.add_argument("--mhc-forms", default=",".join(MHC_FORMS),
                        help="mHC front forms, comma-separated, the first the one the others are "
                             f"checked against (of {', '.join(MHC_FORMS)})")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"parts to time, comma-separated (of {', '.join(PARTS)})")
    args = parser.parse_args(argv)
    forms, mhc_forms, parts = (a.split(",") for a in (args.forms, args.mhc_forms, args.parts))
    for flag, names, known in (("--forms", forms, SINKHORN_FORMS),
                               ("--mhc-forms", mhc_forms, MHC_FORMS), ("--parts", parts, PARTS)):
        if unknown := set(names) - set(known):
            parser.error(f"{flag}: unknown {sorted(unknown)}, expected some of {list(known)}")
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    if "engram" in parts:
        eng = engram_tables(args.rows, rng)
        views = [{name: parallel.host_buffer(leaf) for name, leaf in table.items()}
                 for table in eng.tables]
        gather = jax.jit(gather_rows)
    table = ["| part | tokens | form | first call s | ms a call | kernels a call | max abs diff |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for tokens in (int(x) for x in args.tokens.split(",")):
        if "sinkhorn" in parts:
            logits = jnp.asarray(rng.normal(size=(tokens, 1, 4, 4)), jnp.float32)
            time_forms(table, f"sinkhorn x {args.sites}", tokens,
                       [(label, chained_sinkhorn(fn, args.sites, args.iters))
                        for label, fn in (SINKHORN_FORMS[name] for name in forms)],
                       (logits,), args.reps)
        if "mhc" in parts:
            time_forms(table, f"mhc front x {args.sites}", tokens,
                       [(label, chained_mhc_front(fn, args.sites, args.iters))
                        for label, fn in (MHC_FORMS[name] for name in mhc_forms)],
                       mhc_site(tokens, rng), args.reps)
        if "engram" in parts:
            ids = rng.integers(0, args.rows, (tokens, 1, ENGRAM_LAYERS, COLS)).astype(np.int32)
            compile_s, ms, kernels, looped = timed(gather, eng, jnp.asarray(ids), reps=args.reps)
            table.append(f"| engram rows | {tokens} | loop | {compile_s:.2f} | {ms:.3f} | "
                         f"{kernels} | 0 |")
            print(table[-1], flush=True)
            compile_s, ms, kernels, hosted = timed(host_gathered, eng, views, ids, reps=args.reps)
            diff = float(jnp.max(jnp.abs(hosted - looped)))
            table.append(f"| engram rows | {tokens} | host gather | {compile_s:.2f} | {ms:.3f} | "
                         f"{kernels} | {diff:.1e} |")
            print(table[-1], flush=True)
    print("\n" + "\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
