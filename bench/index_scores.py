"""GPU benchmark of a decode step's lightning-indexer scores over paged keys: the Pallas kernel
(`paged_index_scores_pallas`, a sweep of tiles) against the jnp reference (the engine's path off
the GPU, and for prompt chunks).

DeepSeek-V4.1-Flash's indexer: 32 index heads of 128, bf16 keys, float32 queries (two bf16 terms
in the kernel), pages of 64 tokens: 64 keys a page for a ratio-1 KV source, 32 for a ratio-2 one.
Each row's table holds its pages shuffled in a pool with spare pages; the table is as wide as
its longest row needs (the engine's bucket). Cases: 1 and 4 rows at 4K and 128K tokens (4 rows:
lengths spread down to a quarter). Each tile is checked against the reference on the GPU first
(max error over max |reference| on the finite scores, and the -inf pattern exactly). Reports us
a call, the keys' GB/s against the HBM read ceiling measured in the same run
(bench.ceilings.hbm_read_gbps) and the speed-up over the reference. Prints a markdown table and
writes it to $OUT/index_scores.md when $OUT is set.

    python3 -m bench.index_scores [--tiles 64x4x2,128x4x2] [--reps 20]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import hbm_read_gbps, median_seconds
from tidejax.pallas.index_scores import (TILE, paged_index_scores_pallas,
                                         paged_index_scores_reference)

HEADS, K, PAGE_TOKENS = 32, 128, 64
SCALE = K ** -0.5
CASES = ((1, 4096, 1), (4, 4096, 1), (1, 131072, 1), (4, 131072, 1), (4, 131072, 2))
SWEEP = (TILE, (128, 4, 2), (64, 8, 2))
TOLERANCE = 1e-4  # bf16 keys exact, float32 queries as two bf16 terms


def make_case(b: int, tokens: int, ratio: int, seed: int = 0):
    """Rows of tokens, tokens * 3/4, ... (at least a quarter) -> the kernel's arguments and the
    keys' bytes the rows hold."""
    rng = np.random.default_rng(seed)
    rows = PAGE_TOKENS // ratio
    counts = np.array([tokens // ratio * (4 - i % 4) // 4 for i in range(b)], np.int32)
    n_table = -(-int(counts.max()) // rows)
    n_pages = b * n_table + 64
    table = rng.permutation(n_pages)[:b * n_table].reshape(b, n_table).astype(np.int32)
    keys = jnp.asarray(rng.standard_normal((n_pages, rows, K), np.float32), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((b, 1, HEADS, K), np.float32))
    w = jnp.asarray(rng.standard_normal((b, 1, HEADS), np.float32))
    args = (q, w, keys, jnp.asarray(table), jnp.asarray(counts[:, None]))
    return args, float(counts.sum()) * K * 2


def parse_tiles(text: str):
    return tuple(tuple(int(x) for x in tile.split("x")) for tile in text.split(","))


def check(got, want) -> float:
    """Max error over max |want| on the finite scores; inf if the -inf pattern differs."""
    got, want = np.asarray(got), np.asarray(want)
    live = np.isfinite(want)
    if not np.array_equal(live, np.isfinite(got)):
        return float("inf")
    return float(np.abs(got[live] - want[live]).max() / np.abs(want[live]).max())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", type=parse_tiles, default=SWEEP,
                        help="bk x num_warps x num_stages, comma-separated")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)

    ceiling = hbm_read_gbps()
    reference = jax.jit(paged_index_scores_reference, static_argnames="scale")
    lines = [f"## Paged indexer scores (decode), {datetime.date.today()}, "
             f"{jax.devices()[0].device_kind}, jax {jax.__version__}",
             "",
             f"{HEADS} index heads of {K}, bf16 keys, float32 queries, pages of {PAGE_TOKENS} tokens; "
             f"HBM read ceiling in the same run {ceiling:.0f} GB/s. "
             f"`python3 -m bench.index_scores {' '.join(argv or sys.argv[1:])}`",
             "",
             "| rows | tokens (longest) | ratio | path | tile (bk x warps x stages) | us | keys GB/s "
             "| of ceiling | x reference | max err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for b, tokens, ratio in CASES:
        case, nbytes = make_case(b, tokens, ratio)
        want = reference(*case, scale=SCALE)
        ref_s = median_seconds(lambda *a: reference(*a, scale=SCALE), *case, reps=args.reps)
        where = f"| {b} | {tokens} | {ratio} |"

        def row(path, tile, seconds, err):
            gbps = nbytes / seconds / 1e9
            return (f"{where} {path} | {tile} | {seconds * 1e6:.1f} | {gbps:.0f} | "
                    f"{gbps / ceiling:.2f} | {ref_s / seconds:.2f} | {err} |")

        lines.append(row("jnp reference", "-", ref_s, "-"))
        for tile in args.tiles:
            label = "x".join(map(str, tile))
            try:
                kernel = jax.jit(lambda *a, tile=tile: paged_index_scores_pallas(*a, scale=SCALE,
                                                                                 tile=tile))
                err = check(kernel(*case), want)
                seconds = median_seconds(kernel, *case, reps=args.reps)
            except Exception as exc:  # a tile that does not compile
                lines.append(f"{where} pallas | {label} | fails: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:120]} | | | | |")
                continue
            ok = "" if err < TOLERANCE else " (over tolerance)"
            lines.append(row("pallas", label, seconds, f"{err:.1e}{ok}"))
        print("\n".join(lines[-len(args.tiles) - 1:]), flush=True)
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "index_scores.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
