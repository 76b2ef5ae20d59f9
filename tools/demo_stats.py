"""Figures of the demo model, computed with tidejax on the committed held-out texts.

    python -m tools.demo_stats [--model models/demo] [--window 512] [--max-windows 40] [--json PATH]

Per domain: the held-out loss (mean next-token NLL, nats per token, over non-overlapping windows);
the routing skew (the share of a MoE layer's experts that takes 90% of the domain's picks);
the overlap of the domains' hot sets (each domain's top half of the experts, per layer); and a
few completions at temperature 0. Prints a markdown section (for bench/RESULTS.md).
Picks are the router's wanted picks, read from tidejax's demand counters.
"""

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

from tools.corpus import HELDOUT_DIR as HELDOUT, REPO


PROMPTS = {
    "en": "The most important thing about a computer is",
    "de": "Die wichtigste Regel im Leben ist",
    "fr": "Le système de fichiers",
    "python": "def read_config(path):\n",
    "man": "NAME\n       ls - ",
}
CHATS = {
    "en": "Hello! What is Debian?",
    "de": "Hallo! Was ist Debian?",
    "fr": "Bonjour ! Qu'est-ce que Debian ?",
}


def share_for(counts: np.ndarray, mass: float = 0.9) -> float:
    """Smallest share of experts whose picks add up to `mass` of all picks (counts [E])."""
    c = np.sort(counts)[::-1]
    need = int(np.searchsorted(np.cumsum(c), mass * c.sum() - 1e-6)) + 1
    return need / len(c)


def hot_set(counts: np.ndarray, budget: int) -> set:
    return set(np.argsort(-counts, kind="stable")[:budget].tolist())


def measure(engine, ids: np.ndarray, window: int, max_windows: int):
    """Held-out loss and the picks per (MoE layer, expert) over the windows of `ids`."""
    before = np.asarray(engine.state.experts.counts, np.float64)
    nll, n = 0.0, 0
    for w in range(min(max_windows, len(ids) // window)):
        chunk = ids[w * window:(w + 1) * window]
        logits = engine.logits(chunk).astype(np.float64)
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        nll += float((logz[:-1] - logits[np.arange(window - 1), chunk[1:]]).sum())
        n += window - 1
    picks = np.asarray(engine.state.experts.counts, np.float64) - before
    if (picks < 0).any():
        raise RuntimeError("the demand counters were drained during the measurement")
    return nll / n, picks


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models" / "demo"))
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    import jax

    import tidejax

    # Counters on, never drained: the picks of a domain are the counters' growth over its windows.
    engine = tidejax.load(args.model, residency={"count": True, "drain_every": 1 << 30})
    if not engine.residency.all_resident:
        sys.exit("demo_stats needs every expert resident (no residency budget)")
    domains = sorted(p.stem for p in HELDOUT.glob("*.txt"))
    n_experts = engine.residency.n_experts
    budget = n_experts // 2
    loss, picks = {}, {}
    for d in domains:
        t0 = time.perf_counter()
        ids = np.asarray(engine.tokenizer.encode(HELDOUT.joinpath(f"{d}.txt").read_text(encoding="utf-8")))
        loss[d], picks[d] = measure(engine, ids, args.window, args.max_windows)
        print(f"{d:7s} held-out loss {loss[d]:.3f}  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    n_layers = picks[domains[0]].shape[0]
    skew = {d: [share_for(picks[d][m]) for m in range(n_layers)] for d in domains}
    hot = {d: [hot_set(picks[d][m], budget) for m in range(n_layers)] for d in domains}
    pairs = list(itertools.combinations(domains, 2))
    overlap = {f"{a}/{b}": [len(hot[a][m] & hot[b][m]) / budget for m in range(n_layers)] for a, b in pairs}
    common = [len(set.intersection(*(hot[d][m] for d in domains))) / budget for m in range(n_layers)]
    union = [len(set.union(*(hot[d][m] for d in domains))) / n_experts for m in range(n_layers)]
    samples = {d: engine.generate([PROMPTS[d]], max_new_tokens=args.new_tokens, temperature=0.0)[0]
               for d in domains if d in PROMPTS}
    chats = {d: engine.generate([[{"role": "user", "content": q}]], max_new_tokens=args.new_tokens,
                                temperature=0.0)[0] for d, q in CHATS.items()}

    moe = list(engine.cfg.moe_layers)
    out = ["## Demo model (models/demo): held-out loss, routing skew, hot-set overlap",
           "",
           f"`python -m tools.demo_stats --window {args.window} --max-windows {args.max_windows}` "
           f"({time.strftime('%Y-%m-%d', time.gmtime())}, jax {jax.__version__}, "
           f"{jax.devices()[0].platform}; tidejax forward, all experts resident). "
           f"{n_experts} routed experts per MoE layer (decoder layers {moe}), "
           f"top-{engine.cfg.num_experts_per_tok}; hot set = a domain's top {budget} experts by picks.",
           "",
           "| domain | held-out loss (nats/token) | share of experts taking 90% of picks, per MoE layer | mean |",
           "| --- | --- | --- | --- |"]
    for d in domains:
        out.append(f"| {d} | {loss[d]:.3f} | {' / '.join(f'{s:.2f}' for s in skew[d])} | {np.mean(skew[d]):.2f} |")
    out += ["", f"Hot-set overlap at a budget of {budget} of {n_experts} experts: |A ∩ B| / {budget}, per MoE layer "
            "(1.00 = the same experts, 0.50 = what two random halves share on average).", "",
            "| pair | per MoE layer | mean |", "| --- | --- | --- |"]
    for name, v in overlap.items():
        out.append(f"| {name} | {' / '.join(f'{x:.2f}' for x in v)} | {np.mean(v):.2f} |")
    out.append(f"| all {len(domains)} domains (common share) | {' / '.join(f'{x:.2f}' for x in common)} "
               f"| {np.mean(common):.2f} |")
    out.append(f"| union of the hot sets / all experts | {' / '.join(f'{x:.2f}' for x in union)} "
               f"| {np.mean(union):.2f} |")
    out += ["", f"Completions at temperature 0 ({args.new_tokens} new tokens):", ""]
    for d, text in samples.items():
        out.append(f"- {d}: `{PROMPTS[d]!r}` -> `{text!r}`")
    for d, text in chats.items():
        out.append(f"- chat ({d}): `{CHATS[d]!r}` -> `{text!r}`")
    print("\n".join(out))
    if args.json:
        args.json.write_text(json.dumps({
            "heldout_loss": loss, "share_90": skew, "overlap": overlap, "common": common,
            "picks": {d: picks[d].tolist() for d in domains}, "samples": samples, "chats": chats},
            indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
