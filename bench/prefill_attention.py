"""GPU benchmark of a prompt chunk's paged MLA attention: the Pallas kernel (`paged_mla_prefill_pallas`,
a sweep of tiles) against the jnp path (`paged_mla_prefill_reference`, what the engine ran before).

The 40-layer V3-family shape: 128 heads, latent c 512, rope r 64, bf16 pools, pages of 64, a row of
8,192 positions (its 128 pages shuffled in a pool of 192). Cases: a chunk of 2,048 queries at
positions 6,144..8,191 (the last chunk of an 8K prompt) and one of 512 at 0..511. Reports ms a
layer and for 40 layers, TFLOP/s of the causal work (2 h (2c + r) multiply-adds a visible (query,
key) pair) and its share of the bf16 matmul rate measured in the same run
(bench.ceilings.matmul_tflops), and the speed-up over the jnp path. Each tile is checked against
the reference on the GPU first (max error over max |reference|). Prints a markdown table and
writes it to $OUT/prefill_attention.md when $OUT is set.

    python3 -m bench.prefill_attention [--tiles 2x16x64x4x2,1x32x64x4x2] [--reps 7]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import matmul_tflops, median_seconds
from tidejax.pallas.attention import PREFILL_TILE, paged_mla_prefill_pallas, paged_mla_prefill_reference

H, C, R, PAGE = 128, 512, 64, 64
ROW = 8192  # positions the row's pages hold
SPARE_PAGES = 64
LAYERS = 40
SCALE = 192 ** -0.5  # V3's qk_head_dim 192
CASES = ((2048, 6144), (512, 0))  # (queries in the chunk, its first position)
SWEEP = (PREFILL_TILE, (2, 16, 64, 4, 3), (1, 32, 64, 4, 2), (2, 16, 128, 4, 2), (2, 16, 32, 4, 2),
         (1, 64, 64, 8, 2), (4, 16, 64, 8, 2), (2, 16, 64, 8, 2))
TOLERANCE = 2e-2  # bf16 output, probabilities rounded to bf16 against other running maxima


def make_case(t: int, start: int, seed: int = 0):
    """Queries [1, t, H, C|R] (bf16), bf16 pools of ROW / PAGE + SPARE_PAGES pages, a shuffled
    table of the row's pages, positions start.. -> the kernel's arguments."""
    rng = np.random.default_rng(seed)
    n_pages = ROW // PAGE + SPARE_PAGES
    bf16 = jnp.bfloat16
    q = jnp.asarray(rng.standard_normal((1, t, H, C), np.float32) / np.sqrt(C), bf16)
    q_rope = jnp.asarray(rng.standard_normal((1, t, H, R), np.float32) / np.sqrt(R), bf16)
    latent = jnp.asarray(rng.standard_normal((n_pages, PAGE, C), np.float32), bf16)
    rope = jnp.asarray(rng.standard_normal((n_pages, PAGE, R), np.float32), bf16)
    table = jnp.asarray(rng.permutation(n_pages)[:ROW // PAGE][None], jnp.int32)
    positions = jnp.asarray(np.arange(start, start + t)[None], jnp.int32)
    return q, q_rope, latent, rope, table, positions


def causal_flops(t: int, start: int) -> float:
    """FLOPs of the visible (query, key) pairs: scores (c + r) and output (c) multiply-adds a head."""
    keys = np.minimum(np.arange(start, start + t), ROW - 1) + 1
    return 2.0 * H * (2 * C + R) * float(keys.sum())


def parse_tiles(text: str):
    return tuple(tuple(int(x) for x in tile.split("x")) for tile in text.split(","))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", type=parse_tiles, default=SWEEP,
                        help="bq x bh x bk x num_warps x num_stages, comma-separated")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)

    peak = matmul_tflops()
    reference = jax.jit(paged_mla_prefill_reference, static_argnames="scale")
    lines = [f"## Paged MLA prefill attention, {datetime.date.today()}, {jax.devices()[0].device_kind}, "
             f"jax {jax.__version__}",
             "",
             f"h {H}, c {C}, r {R}, bf16 pools, pages of {PAGE}, a row of {ROW} positions; bf16 matmul "
             f"8192^3 in the same run: {peak:.0f} TFLOP/s. "
             f"`python3 -m bench.prefill_attention {' '.join(argv or sys.argv[1:])}`",
             "",
             "| chunk | positions | path | tile (bq x bh x bk x warps x stages) | ms a layer | ms, 40 layers "
             "| TFLOP/s | of matmul | x jnp | max err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t, start in CASES:
        case = make_case(t, start)
        flops = causal_flops(t, start)
        want = reference(*case, scale=SCALE)
        ref_s = median_seconds(lambda *a: reference(*a, scale=SCALE), *case, reps=args.reps)
        where = f"| {t} | {start}..{start + t - 1} |"

        def row(path, tile, seconds, err):
            tflops = flops / seconds / 1e12
            return (f"{where} {path} | {tile} | {seconds * 1e3:.2f} | {seconds * 1e3 * LAYERS:.1f} | "
                    f"{tflops:.0f} | {tflops / peak:.2f} | {ref_s / seconds:.2f} | {err} |")

        lines.append(row("jnp reference", "-", ref_s, "-"))
        best = None
        for tile in args.tiles:
            label = "x".join(map(str, tile))
            try:
                kernel = jax.jit(lambda *a, tile=tile: paged_mla_prefill_pallas(*a, scale=SCALE, tile=tile))
                got = kernel(*case)
                err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))
                            / jnp.max(jnp.abs(want.astype(jnp.float32))))
                seconds = median_seconds(kernel, *case, reps=args.reps)
            except Exception as exc:  # a tile that does not compile (shared memory, registers)
                lines.append(f"{where} pallas | {label} | fails: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:120]} | | | | | |")
                continue
            ok = "" if err < TOLERANCE else " (over tolerance)"
            lines.append(row("pallas", label, seconds, f"{err:.1e}{ok}"))
            if err < TOLERANCE and (best is None or seconds < best[0]):
                best = (seconds, label)
        if best:
            lines.append(f"{where} **best** | {best[1]} | {best[0] * 1e3:.2f} | | | | "
                         f"{ref_s / best[0]:.2f} | |")
        print("\n".join(lines[-len(args.tiles) - 2:]), flush=True)
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "prefill_attention.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
