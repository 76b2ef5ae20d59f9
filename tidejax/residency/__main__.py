"""python -m tidejax.residency fit --history H --budget B --out MAP [--geometry per_layer|arena]"""

from __future__ import annotations

import argparse
import sys

from tidejax.residency import seedmap
from tidejax.residency.history import History


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tidejax.residency")
    sub = parser.add_subparsers(dest="command", required=True)
    fit = sub.add_parser("fit", help="fit a seed map from a saved demand history")
    fit.add_argument("--history", required=True, help="history file (state_dir/history.npz)")
    fit.add_argument("--budget", required=True, type=int, help="resident expert slots")
    fit.add_argument("--out", required=True, help="seed map to write (JSON)")
    fit.add_argument("--geometry", default="per_layer", choices=("per_layer", "arena"))
    args = parser.parse_args(argv)
    try:
        history = History.read(args.history)
        seed = seedmap.fit(history, args.budget, args.geometry)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        seedmap.write(seed, args.out)
    except OSError as e:
        print(f"error: --out {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    n_layers, n_experts = history.shape
    total = history.demand.sum()
    kept = history.demand.reshape(-1)[seed["rows"]].sum()
    share = kept / total if total else 0.0
    print(f"{args.out}: {len(seed['rows'])} of {n_layers * n_experts} experts ({args.geometry}), "
          f"covering {share:.1%} of the history's demand (routing weight)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
