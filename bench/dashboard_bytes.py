"""Bytes a dashboard poll's heatmap takes (server/dashboard.py's Heatmap) against the demand as JSON
numbers (the form before it), for a DeepSeek-V3-size map by default: 58 MoE layers x 256 experts,
top-8, a decode of 4 lanes routing to a skewed (Zipf) popularity per layer, drained into a
History every 64 steps with a half-life of 500 (the [residency] defaults). Printed: the bytes of
the old form, of every row (the first poll), of a poll when nothing changed, and of a poll after
each of the next drains, with the rows it carries, the cells whose heat byte moved and the
largest move (in heat steps): a row is sent when one of its bytes changed, so these say why.

`--traffic expected` drains each layer's expected demand instead of a draw from it (steady
traffic with no sampling noise: the history converges, and the rows stop changing once every
heat byte holds still); `sampled` (the default) is a decode's draw.

    python -m bench.dashboard_bytes [--layers 58] [--experts 256] [--drains 10]
                                    [--traffic sampled|expected]
"""

from __future__ import annotations

import argparse
import base64
import json

import numpy as np

from tidejax.residency.history import History
from tidejax.server.dashboard import Heatmap


def drain(history: History, popularity: np.ndarray, rng, top_k: int, tokens: int) -> None:
    """`tokens` tokens' picks (top_k distinct experts a layer, drawn by popularity [L, E] with
    the Gumbel top-k trick) and Dirichlet routing weights, added to `history` as one drain."""
    layers, experts = popularity.shape
    scores = np.log(popularity)[:, None, :] + rng.gumbel(size=(layers, tokens, experts))
    ids = np.argsort(-scores, axis=-1)[..., :top_k]  # [L, tokens, k]
    weights = rng.dirichlet(np.ones(top_k), size=(layers, tokens))  # [L, tokens, k]
    counts, sums = np.zeros((layers, experts)), np.zeros((layers, experts))
    for layer in range(layers):
        np.add.at(counts[layer], ids[layer].reshape(-1), 1)
        np.add.at(sums[layer], ids[layer].reshape(-1), weights[layer].reshape(-1))
    history.add(counts, sums, tokens)


def drain_expected(history: History, popularity: np.ndarray, top_k: int, tokens: int) -> None:
    """`tokens` tokens' expected picks and routing weight by popularity [L, E] as one drain (the
    routing weights of a token's top_k picks sum to 1)."""
    history.add(popularity * tokens * top_k, popularity * tokens, tokens)


def heats(heatmap: Heatmap) -> np.ndarray:
    """[L, E] the heat bytes the heatmap's rows hold now (each row's first E bytes)."""
    return np.stack([np.frombuffer(base64.b64decode(row), np.uint8)[:heatmap.experts]
                     for row in heatmap.rows]).astype(int)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=58)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--drain-every", type=int, default=64)
    parser.add_argument("--half-life", type=float, default=500.0)
    parser.add_argument("--warm-drains", type=int, default=20, help="drains before measuring")
    parser.add_argument("--drains", type=int, default=10, help="drains measured")
    parser.add_argument("--traffic", choices=("sampled", "expected"), default="sampled",
                        help="measured drains: a draw of picks, or the expected demand")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    popularity = rng.zipf(1.3, size=(args.layers, args.experts)).astype(float)
    popularity /= popularity.sum(axis=1, keepdims=True)
    history = History(args.layers, args.experts, args.half_life)
    tokens = args.drain_every * args.lanes
    for _ in range(args.warm_drains):
        drain(history, popularity, rng, args.top_k, tokens)
    resident = np.zeros(history.shape, bool)  # the busier half of each layer
    for layer, row in enumerate(history.demand):
        resident[layer, np.argsort(-row)[:args.experts // 2]] = True
    as_numbers = len(json.dumps({"demand": history.demand.tolist(),
                                 "resident": resident.tolist()}))
    heatmap = Heatmap()
    heatmap.update(history.demand, resident)
    every_row = len(json.dumps(heatmap.since(None)))
    version = heatmap.token
    heatmap.update(history.demand, resident)
    unchanged = len(json.dumps(heatmap.since(version)))
    after_drain = []
    for _ in range(args.drains):
        version, before = heatmap.token, heats(heatmap)
        if args.traffic == "expected":
            drain_expected(history, popularity, args.top_k, tokens)
        else:
            drain(history, popularity, rng, args.top_k, tokens)
        heatmap.update(history.demand, resident)
        poll, moved = heatmap.since(version), np.abs(heats(heatmap) - before)
        after_drain.append((len(json.dumps(poll)), len(poll["rows"]), int((moved > 0).sum()),
                            int(moved.max())))
    out = {"shape": list(history.shape), "as_numbers": as_numbers, "every_row": every_row,
           "unchanged": unchanged, "after_drain": after_drain}
    print(f"{args.layers} x {args.experts}: JSON numbers {as_numbers:,} B; every row "
          f"{every_row:,} B ({as_numbers / every_row:.1f}x fewer); nothing changed "
          f"{unchanged:,} B; after a drain (B, rows, cells moved, largest move): {after_drain}")
    return out


if __name__ == "__main__":
    main()
