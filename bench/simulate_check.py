"""simulate's predicted decode tok/s against a measured run on the same machine (issue 36 item 4).

    python -m bench.simulate_check MODEL [--trace ''] [--resident 0.5,0.65,0.8]
        [--policy substitute] [--lanes 1] [--tokens 128] [--domain en] [--set table.key=value ...]

Per resident share, one fresh engine (bench.roofline.load_config: the budget, the miss policy, a
seed map fitted on --trace's picks where one is replayed) with the routing trace recorder on
(`residency.trace_every_steps = 1` under a temporary state_dir; without a seed map its map at
the end of the load, after calibration, is written as one for the replay): the warm-up of
the workload's step shapes, then --lanes prompts of held-out text each decoding --tokens
tokens; the measured tok/s is bench.roofline's (lanes over the median seconds of the steady
decode steps). Then
`python -m tidejax.residency simulate` replays that engine's trace at its own budget with the
bandwidths measured here (HBM read: bench.ceilings; the in-step host-to-device fetch and the host
kernel: bench.roofline's over the engine's own bank), the expert bytes as held and the bytes
every decode step reads besides the routed experts (the dense weights and the KV cache of the
lanes at their mean context), and its decode tok/s is set beside the measured one.

Prints a markdown table (and writes it to $OUT/simulate_check.md where $OUT is set): resident
share, budget, the decode steps' cold share (the engine's, from its trace's resident flags, and
simulate's: the steps the prediction counts; a load without a seed map calibrates on a scoring
forward the replay runs on the calibrated map), measured and predicted tok/s and the error
(predicted / measured - 1).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import tempfile
from pathlib import Path

import jax

from bench.ceilings import hbm_read_gbps
from bench.roofline import (PROMPT_TOKENS, dense_bytes, h2d_gbps, host_kernel_gbps, load_config,
                            parse_set, report, steady_decode)
from tidejax.residency import seedmap, simulate
from tidejax.residency.__main__ import main as residency_cli

OWN_PICKS = "the router's own picks"
HEADER = ("| resident | budget | policy | lanes | decode cold share: engine / simulate | "
          "measured tok/s | predicted tok/s | error |")


def check_share(model: str, share: float, args, overrides: dict, workdir: Path,
                bandwidths: dict) -> str:
    """One resident share served, measured and simulated: its table row. `bandwidths` (GB/s:
    hbm, h2d, host) is filled on the first call from its engine's bank."""
    state_dir = workdir / f"state-{share}"
    tables = {k: dict(v) for k, v in overrides.items()}
    tables.setdefault("residency", {}).update(state_dir=str(state_dir), trace_every_steps=1)
    engine, _ = load_config(model, share, args.policy,
                            argparse.Namespace(trace=args.trace, lanes=[args.lanes]), tables,
                            workdir, PROMPT_TOKENS + args.tokens + 64)
    bank = engine.state.experts.bank
    boot = engine.config.residency.seed_map or boot_map(engine, workdir / f"boot-{share}.json")
    if not bandwidths:
        bandwidths.update(hbm=hbm_read_gbps(args.ceiling_mib << 20), h2d=h2d_gbps(bank))
        if args.policy in ("cpu", "auto"):
            bandwidths["host"] = host_kernel_gbps(bank, engine.family.top_k(engine.cfg))
        print("measured GB/s: " + ", ".join(f"{k} {v:.4g}" for k, v in bandwidths.items()),
              flush=True)
    engine.warmup([PROMPT_TOKENS])  # the step shapes of this workload's prompts
    _, steady = steady_decode(engine, args.lanes, args.tokens, args.domain)
    measured = args.lanes / sorted(r.seconds for r in steady)[len(steady) // 2]
    context = PROMPT_TOKENS + args.tokens / 2  # the lanes' mean position while decoding
    step_mib = (dense_bytes(engine)
                + engine.cache_bytes_per_token() * context * args.lanes) / 2**20
    expert_bytes, budget = engine.residency.row_bytes, engine.residency.n_resident
    engine.close()  # writes the trace's last chunk
    del engine
    gc.collect()  # free the pool and the bank before the next share loads
    rows_json = workdir / f"simulate-{share}.json"
    command = ["simulate", "--trace", str(state_dir / "routing"), "--seed-map", boot,
               "--budgets", str(budget),
               "--lanes", str(args.lanes), "--expert-bytes", str(expert_bytes),
               "--step-mib", f"{step_mib:.6f}", "--hbm-gbps", f"{bandwidths['hbm']:.6g}",
               "--h2d-gbps", f"{bandwidths['h2d']:.6g}", "--json", str(rows_json)]
    if "host" in bandwidths:
        command += ["--host-gbps", f"{bandwidths['host']:.6g}"]
    print("python -m tidejax.residency " + " ".join(command), flush=True)
    if residency_cli(command) != 0:
        raise RuntimeError(f"simulate failed on the trace of share {share}")
    row = json.loads(rows_json.read_text())[0]
    predicted = row["decode_tps"]
    cold = simulate.read_trace(state_dir / "routing").measured_cold_share(args.lanes)
    return (f"| {share:.0%} | {budget} | {args.policy} | {args.lanes} | "
            f"{cold:.4f} / {row['decode_cold_share']:.4f} | {measured:.1f} | "
            f"{predicted:.1f} | {predicted / measured - 1:+.1%} |")


def boot_map(engine, path: Path) -> str:
    """The engine's map as it starts serving, written as a seed map: without one the engine
    calibrates at load (a scoring forward, then the resident set moved between steps), which
    the trace records only the forward of."""
    residency = engine.residency
    rows = [int(r) for r in residency.slot_rows[:residency.n_resident] if r >= 0]
    seedmap.write({"format": seedmap.FORMAT, "geometry": residency.geometry,
                   "n_layers": residency.n_layers, "n_experts": residency.n_experts,
                   "budget": residency.n_resident, "rows": rows}, path)
    return str(path)


def main(argv=None) -> int:
    logging.basicConfig(format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="checkpoint directory")
    parser.add_argument("--trace", default="", help="routing trace to replay into the router "
                        "(bench/traces.py; '' = the router's own picks)")
    parser.add_argument("--domain", default="en", help="held-out text for the prompts")
    parser.add_argument("--resident", default="0.5,0.65,0.8", help="resident shares (< 1)")
    parser.add_argument("--policy", default="substitute", help="miss policy")
    parser.add_argument("--lanes", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128, help="decoded tokens per request")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    parser.add_argument("--ceiling-mib", type=int, default=1024,
                        help="bytes the HBM read ceiling streams (>= 1 GiB on a GPU)")
    args = parser.parse_args(argv)
    shares = [float(x) for x in args.resident.split(",")]
    if any(not 0 < s < 1 for s in shares):
        raise SystemExit(f"error: --resident {args.resident}: shares in (0, 1)")
    overrides = parse_set(args.set)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    bandwidths: dict = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for share in shares:
            row = check_share(args.model, share, args, overrides, Path(tmp), bandwidths)
            print(row, flush=True)
            rows.append(row)
    table = "\n".join([HEADER, "|" + " --- |" * 8] + rows)
    report("simulate_check.md",
           f"{datetime.date.today()}, jax {jax.__version__} on {jax.devices()[0].device_kind}, "
           f"{args.model}, routing {args.trace or OWN_PICKS}; measured GB/s: "
           + ", ".join(f"{k} {v:.4g}" for k, v in bandwidths.items()) + f"\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
