"""GPU benchmark of expert residency (one call, one table).

1. Host-to-device bandwidth: `jax.device_put` of a pinned_host expert pool (MXFP4 rows of
   DeepSeek-V4.1-Flash size: hidden 5120, moe_intermediate 2304, 18.8 MB a row) to device memory.
2. Swaps: `Residency.apply_swaps` of one row from the pinned pool into the bank (a swap batch
   through the jitted, donated `apply_now`, then a wait for it), median over random swaps, and of a step's worth
   (max_swaps_per_step) in one call; GB/s against (1); the swap's compiled memory analysis
   (in place: alias = the state, temp ~ one row).
3. Miss policies: a decode-like step of one MoE layer (64 experts, half resident) with "exact"
   (missing rows fetched from the pinned pool inside the step) against "substitute".
4. Demand counting A/B: a decode-like step of L_MOE MoE layers (router + serve_routed + the
   grouped kernel over an MXFP4 bank, 4 tokens, top-6 of 384) with counting on and off, blocks
   interleaved; all-resident and half-resident (substitute, with the per-step miss read the manager
   does) banks.

    python3 -m bench.residency [--quick]

Prints a markdown table and writes it to $OUT/residency.md when $OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from tidejax.config import ResidencySection
from tidejax.residency import Residency, ServeOptions, serve_routed
from tidejax.residency.planner import Swap
from tidejax.residency.state import ExpertState, zero_counters
from tidejax.residency.swap import SwapBatch, apply_now


def dims(quick: bool):
    # D, I, experts per layer, MoE layers in the counting step, top-k, pool rows (one layer)
    return (64, 64, 16, 2, 6, 16) if quick else (5120, 2304, 384, 4, 6, 64)


def mxfp4_rows(n, d, i, rng) -> dict:
    """Random MXFP4 rows (every e2m1 code; scales near 1 so values stay finite)."""
    b = lambda *s: rng.integers(0, 256, s, dtype=np.uint8)
    s = lambda *s: rng.integers(118, 128, s, dtype=np.uint8)
    return {"gate_up_blocks": b(n, 2 * i, d // 32, 16), "gate_up_scales": s(n, 2 * i, d // 32),
            "down_blocks": b(n, d, i // 32, 16), "down_scales": s(n, d, i // 32)}


def device_rows(n, d, i, key, distinct=32) -> dict:
    """n MXFP4 rows on the device: `distinct` random rows repeated (little scratch memory)."""
    base = jax.device_put(mxfp4_rows(distinct, d, i, np.random.default_rng(int(key))))
    return jax.jit(lambda b: jax.tree.map(lambda a: a[jnp.arange(n) % distinct], b))(base)


def h2d_gbps(pool: dict) -> float:
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
    nbytes = sum(a.nbytes for a in jax.tree.leaves(pool))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        out = jax.block_until_ready(jax.device_put(pool, dev))
        times.append(time.perf_counter() - t0)
        del out
    return nbytes / min(times) / 1e9


def bench_swaps(res: Residency, state, n_swaps: int, rng):
    slots = res.n_resident
    compiled = apply_now.lower(state, SwapBatch.of([(0, 0)], res.batch_length)).compile()
    mem = compiled.memory_analysis()
    times = []
    for _ in range(n_swaps + 3):
        cold = np.setdiff1d(np.arange(res.n_experts), res.slot_rows)
        swap = Swap(int(rng.integers(slots)), int(rng.choice(cold)), res.version)
        t0 = time.perf_counter()
        state = res.apply_swaps(state, [swap])
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    batched = []  # a step's worth of swaps (max_swaps_per_step) in one call
    for _ in range(max(3, n_swaps // 8)):
        cold = rng.permutation(np.setdiff1d(np.arange(res.n_experts), res.slot_rows))
        swaps = [Swap(int(s), int(r), res.version) for s, r in
                 zip(rng.permutation(slots)[:res.section.max_swaps_per_step], cold)]
        t0 = time.perf_counter()
        state = res.apply_swaps(state, swaps)
        jax.block_until_ready(state)
        batched.append((time.perf_counter() - t0) / len(swaps))
    state_bytes = sum(a.nbytes for a in jax.tree.leaves(state))
    return statistics.median(times[3:]), statistics.median(batched[1:]), mem, state_bytes, state


def counting_step(n_layers, top_k):
    def step(state, x, router, options):
        for layer in range(n_layers):
            logits = jnp.einsum("td,ed->te", x, router[layer], preferred_element_type=jnp.float32)
            top, ids = jax.lax.top_k(logits, top_k)
            weights = jax.nn.softmax(top, axis=-1)
            y, state = serve_routed(layer, x, ids.astype(jnp.int32), weights, logits,
                                    jnp.ones(x.shape[0], bool), state, options)
            x = (x.astype(jnp.float32) + y.astype(jnp.float32) * 0.01).astype(x.dtype)
        return x, state
    return jax.jit(step, static_argnames="options", donate_argnums=0)


def bench_policies(res: Residency, state, d: int, top_k: int, steps: int):
    """Median step time of one MoE layer, 4 tokens: exact vs substitute; rows fetched a step."""
    step = counting_step(1, top_k)
    key = jax.random.key(5)
    router = (jax.random.normal(key, (1, res.n_experts, d), jnp.float32) * 0.02).astype(jnp.bfloat16)
    out = {}
    for policy in ("exact", "substitute"):
        opts = dataclasses.replace(res.options, miss_policy=policy)
        times, fetched = [], []
        for j in range(steps + 2):
            x = jax.random.normal(jax.random.fold_in(key, j), (4, d), jnp.float32).astype(jnp.bfloat16)
            before = float(state.misses.sum())
            t0 = time.perf_counter()
            y, state = step(state, x, router, opts)
            jax.block_until_ready((y, state))
            times.append(time.perf_counter() - t0)
            fetched.append(float(state.misses.sum()) - before)
        out[policy] = (statistics.median(times[2:]), statistics.mean(fetched[2:]))
    return out


def bench_counting(state, step, router, xs, options_on, options_off, read_misses, blocks, per):
    """Median step time (s) with counting on / off: `blocks` interleaved blocks of `per` steps,
    each step read back to the host as the engine reads its tokens."""
    arms = {"on": options_on, "off": options_off}
    times = {"on": [], "off": []}
    for arm, opts in arms.items():  # compile + warm up
        _, state = step(state, xs[0], router, opts)
        jax.block_until_ready(state)
    for b in range(blocks):
        for arm in (("on", "off") if b % 2 == 0 else ("off", "on")):
            t0 = time.perf_counter()
            for j in range(per):
                y, state = step(state, xs[j % len(xs)], router, arms[arm])
                np.asarray(y[0, :4])  # the engine reads each step's tokens back
                if read_misses and arm == "on":
                    np.asarray(state.misses)  # the manager's per-step miss tally
            jax.block_until_ready(state)
            times[arm].append((time.perf_counter() - t0) / per)
    return statistics.median(times["on"]), statistics.median(times["off"]), state


def swap_and_policy_rows(quick: bool) -> list:
    d, i, _, _, k, pool_rows = dims(quick)
    rng = np.random.default_rng(0)
    pool_np = mxfp4_rows(pool_rows, d, i, rng)
    row_mb = sum(a[0].nbytes for a in pool_np.values()) / 1e6
    section = ResidencySection(budget_experts=pool_rows // 2, miss_policy="exact", adapt=False)
    res = Residency(pool_np, 1, k, section, max_tokens=4)
    del pool_np
    swap_s, batched_s, mem, state_bytes, state = bench_swaps(res, res.take_state(),
                                                             10 if quick else 60, rng)
    bw = h2d_gbps(state.pool)
    swap_gbps = row_mb / 1e3 / swap_s
    rows = [("host->device, device_put of the pinned pool", f"{bw:.1f} GB/s "
             f"({pool_rows} rows, {pool_rows * row_mb / 1e3:.2f} GB)"),
            (f"one swap ({row_mb:.1f} MB MXFP4 row, pinned host -> bank slot), median",
             f"{swap_s * 1e6:.0f} us = {swap_gbps:.1f} GB/s = {swap_gbps / bw:.2f} of host->device"),
            (f"{res.section.max_swaps_per_step} swaps in one call, per swap, median",
             f"{batched_s * 1e6:.0f} us = {row_mb / 1e3 / batched_s / bw:.2f} of host->device"),
            ("swap memory_analysis: alias / temp / state bytes",
             f"{mem.alias_size_in_bytes / 1e6:.1f} MB / {mem.temp_size_in_bytes / 1e6:.1f} MB / "
             f"{state_bytes / 1e6:.1f} MB")]
    print(rows, "\n", mem, flush=True)
    try:
        for policy, (secs, missed) in bench_policies(res, state, d, k, 5 if quick else 20).items():
            rows.append((f"one MoE layer, 4 tokens, {pool_rows // 2} of {pool_rows} experts "
                         f"resident, miss policy {policy}",
                         f"{secs * 1e6:.0f} us a step ({missed:.1f} missed picks a step)"))
    except Exception as e:  # keep the figures measured so far
        traceback.print_exc()
        rows.append(("miss policies", f"FAILED: {type(e).__name__}: {str(e)[:200]}"))
    return rows


def counting_rows(quick: bool) -> list:
    d, i, e, n_moe, k, _ = dims(quick)
    step = counting_step(n_moe, k)
    key = jax.random.key(1)
    router = (jax.random.normal(key, (n_moe, e, d), jnp.float32) * 0.02).astype(jnp.bfloat16)
    xs = [jax.random.normal(jax.random.fold_in(key, j), (4, d), jnp.float32).astype(jnp.bfloat16)
          for j in range(8)]
    blocks, per = (2, 3) if quick else (10, 40)
    rows = []
    for label, resident in (("all resident", n_moe * e), ("half resident, substitute", n_moe * e // 2)):
        bank = device_rows(resident, d, i, 99)
        keep = np.sort(np.random.default_rng(2).permutation(n_moe * e)[:resident])
        rowmap = np.full(n_moe * e, -1, np.int32)
        rowmap[keep] = np.arange(resident)
        state = ExpertState(bank=bank, rowmap=jnp.asarray(rowmap.reshape(n_moe, e)),
                            slot_rows=jnp.asarray(keep.astype(np.int32)), pool=None,
                            resident=resident, **zero_counters(n_moe, e))
        full = resident == n_moe * e
        on = ServeOptions(miss_policy="substitute", kernel="auto", count=True, all_resident=full)
        off = ServeOptions(miss_policy="substitute", kernel="auto", count=False, all_resident=full)
        t_on, t_off, state = bench_counting(state, step, router, xs, on, off, not full, blocks, per)
        rows.append((f"decode-like step, {n_moe} MoE layers of {e} experts, 4 tokens, top-{k}, "
                     f"{label}: counting on / off",
                     f"{t_on * 1e6:.0f} / {t_off * 1e6:.0f} us ({(t_on / t_off - 1) * 100:+.2f}%)"))
        print(rows[-1], flush=True)
        del state, bank
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    args = parser.parse_args()
    t_start = time.perf_counter()
    rows = []
    for name, section in (("swap", swap_and_policy_rows), ("counting", counting_rows)):
        try:
            rows += section(args.quick)
        except Exception as e:  # one section's failure keeps the others' figures
            traceback.print_exc()
            rows.append((name, f"FAILED: {type(e).__name__}: {str(e)[:200]}"))
    table = [f"## Residency (bench/residency.py{' --quick' if args.quick else ''}), "
             f"{datetime.date.today()}, jax {jax.__version__}, {jax.devices()[0].device_kind}", "",
             "| what | figure |", "| --- | --- |"] + [f"| {a} | {b} |" for a, b in rows]
    table.append(f"\n({time.perf_counter() - t_start:.0f} s)")
    text = "\n".join(table) + "\n"
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "residency.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
