"""What a miss policy costs in quality: held-out NLL of a model with part of its routed experts
resident, for each miss policy, beside all resident (issue 17's quality figure; CPU is enough).

    python -m bench.policy_nll [MODEL] [--resident 0.5] [--policies exact,substitute,ring,cpu,auto]
        [--chunk 128] [--tokens 2048] [--domains de,en,fr,man,python] [--set table.key=value ...]

MODEL defaults to the bundled demo model. Each domain's held-out text (data/heldout) is
scored in chunks of CHUNK tokens, each a fresh forward (Engine.logits) that starts with the
tokenizer's first token; the NLL is the mean over every predicted token of all chunks. The
chunks go one after another through one engine a policy, so residency learns between them as
it does while serving (drains, swaps, the ring). Prints one markdown table: NLL a domain, the
mean, its change against all resident, the cold share and the share of routing weight served
approximately (`approx_weight_share_total`). --set applies to every run but for its [residency]
keys, which go to the policies' runs only (the all-resident baseline has no misses to serve).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np

from bench import roofline
from tools.corpus import HELDOUT_DIR as HELDOUT, REPO


def chunk_nll(logits: np.ndarray, ids: list[int]) -> tuple[float, int]:
    """Summed NLL of ids[1:] under logits[:-1] (float64), and how many tokens it covers."""
    x = logits[:-1].astype(np.float64)
    top = x.max(-1, keepdims=True)
    logp = x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].sum()), len(ids) - 1


def domain_nll(engine, text: str, chunk: int, tokens: int) -> float:
    ids = engine.tokenizer.encode(text)
    first, body = ids[0], ids[1:tokens + 1]
    total, count = 0.0, 0
    for start in range(0, len(body) - chunk + 2, chunk - 1):
        piece = [first] + body[start:start + chunk - 1]
        nll, n = chunk_nll(engine.logits(piece), piece)
        total, count = total + nll, count + n
    return total / count


def run(model: str, resident: float, policy: str | None, args, overrides: dict) -> dict:
    import tidejax

    n_moe, n_experts, _ = roofline.moe_dims(model)
    tables = {k: dict(v) for k, v in overrides.items() if policy is not None or k != "residency"}
    tables.setdefault("engine", {}).setdefault("max_context", args.chunk + 16)
    if policy is not None:
        res = tables.setdefault("residency", {})
        res["budget_experts"] = int(round(resident * n_moe * n_experts))
        res["miss_policy"] = policy
        if policy == "ring":
            res.setdefault("ring_slots", max(8, n_experts // 8))
    engine = tidejax.load(model, **tables)
    row = {d: domain_nll(engine, (HELDOUT / f"{d}.txt").read_text(), args.chunk, args.tokens)
           for d in args.domains}
    stats = engine.residency.stats()
    row |= {"cold": stats["cold_share_total"],
            "approx": stats.get("approx_weight_share_total", 0.0)}
    engine.close()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=str(REPO / "models" / "demo"))
    parser.add_argument("--resident", type=float, default=0.5)
    parser.add_argument("--policies", default="exact,substitute,ring,cpu,auto")
    parser.add_argument("--chunk", type=int, default=128, help="tokens a scored forward")
    parser.add_argument("--tokens", type=int, default=2048, help="held-out tokens a domain")
    parser.add_argument("--domains", default="de,en,fr,man,python")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    args = parser.parse_args(argv)
    args.domains = args.domains.split(",")
    overrides = roofline.parse_set(args.set)
    rows = {"all resident": run(args.model, 1.0, None, args, overrides)}
    for policy in args.policies.split(","):
        rows[policy] = run(args.model, args.resident, policy, args, overrides)
        print(f"{policy}: {rows[policy]}", flush=True)
    base = np.mean([rows["all resident"][d] for d in args.domains])
    head = ["policy", *args.domains, "mean", "vs all resident", "cold share", "approx. weight"]
    lines = [f"{datetime.date.today()}, {Path(args.model).name}, {args.resident:.0%} resident, "
             f"{args.tokens} held-out tokens a domain in chunks of {args.chunk}:", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, row in rows.items():
        mean = np.mean([row[d] for d in args.domains])
        lines.append("| " + " | ".join(
            [name, *(f"{row[d]:.4f}" for d in args.domains), f"{mean:.4f}",
             f"{(mean / base - 1) * 100:+.2f}%", f"{row['cold']:.3f}",
             f"{row['approx']:.3f}"]) + " |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
