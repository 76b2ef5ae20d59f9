"""python -m tidejax.residency fit --history H --budget B --out MAP [--geometry per_layer|arena]
python -m tidejax.residency simulate (--trace DIR | --history H --top-k K) [--budgets B,...]
    [--geometries per_layer,arena] [--host-budgets H,...] [--set residency.key=value ...]
    [--seed-map MAP] [--lanes N] [--expert-bytes N] [--step-mib M] [--hbm-gbps X] [--h2d-gbps X]
    [--host-gbps X] [--disk-gbps X]
    [--measure D,I [--expert-format bf16|mxfp4]] [--target-tps T] [--png PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import sys

import numpy as np

from tidejax.config import parse_set
from tidejax.errors import ConfigError
from tidejax.residency import seedmap, simulate
from tidejax.residency.history import History
from tidejax.residency.persist import write_atomic
from tidejax.residency.pool import row_bytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tidejax.residency")
    sub = parser.add_subparsers(dest="command", required=True)
    fit = sub.add_parser("fit", help="fit a seed map from a saved demand history")
    fit.add_argument("--history", required=True, help="history file (state_dir/history.npz)")
    fit.add_argument("--budget", required=True, type=int, help="resident expert slots")
    fit.add_argument("--out", required=True, help="seed map to write (JSON)")
    fit.add_argument("--geometry", default="per_layer", choices=("per_layer", "arena"))
    _simulate_arguments(sub.add_parser(
        "simulate", help="replay a routing trace (or a history) at other budgets and predict "
        "decode tok/s"))
    args = parser.parse_args(argv)
    if args.command == "simulate":
        return _simulate(args)
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


def _numbers(kind):
    def parse(text: str) -> list:
        try:
            return [kind(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {kind.__name__}s separated "
                                             "by commas") from None
    return parse


def _simulate_arguments(sim: argparse.ArgumentParser) -> None:
    source = sim.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="routing trace folder (state_dir/routing)")
    source.add_argument("--history", help="demand history (state_dir/history.npz): its steady "
                        "state")
    sim.add_argument("--top-k", type=int, help="picks per token (with --history)")
    sim.add_argument("--budgets", type=_numbers(int), help="resident expert slots, e.g. 24,48 "
                     "(default: eight from one a layer to all, and the recording engine's)")
    sim.add_argument("--geometries", type=_numbers(str), help="per_layer,arena (default: the "
                     "trace's, else per_layer)")
    sim.add_argument("--host-budgets", type=_numbers(int), help="experts held in host memory, "
                     "the rest read from disk, e.g. 96,120 (default: the trace's "
                     "residency.host_budget_experts; 0: every expert)")
    sim.add_argument("--set", action="append", default=[], metavar="residency.KEY=VALUE",
                     help="a [residency] setting over the trace's (repeatable)")
    sim.add_argument("--seed-map", help="boot map (default: the trace's residency.seed_map; "
                     "none: the first slots of each layer)")
    sim.add_argument("--lanes", type=int, help="a step of at most this many tokens is a "
                     "decode step (default 1)")
    sim.add_argument("--expert-bytes", type=int, help="bytes of one expert row as held "
                     "(Residency.row_bytes)")
    sim.add_argument("--step-mib", type=float, default=0.0, help="MiB every decode step reads "
                     "besides the routed experts: dense weights, KV cache (default 0)")
    sim.add_argument("--hbm-gbps", type=float, help="device memory read GB/s")
    sim.add_argument("--h2d-gbps", type=float, help="host-to-device GB/s")
    sim.add_argument("--host-gbps", type=float, help="host kernel GB/s (miss_policy cpu, auto)")
    sim.add_argument("--disk-gbps", type=float, help="disk read GB/s of expert rows (with "
                     "host budgets)")
    sim.add_argument("--measure", type=_numbers(int), metavar="D,I", help="measure the "
                     "bandwidths not given on this machine (bench/), on experts of hidden D and "
                     "intermediate I")
    sim.add_argument("--expert-format", choices=("bf16", "mxfp4"),
                     help="the measured experts' format (with --measure; default bf16)")
    sim.add_argument("--target-tps", type=float, help="answer the smallest budget reaching "
                     "this decode tok/s")
    sim.add_argument("--png", help="write cold share and predicted tok/s against budget "
                     "(needs matplotlib)")
    sim.add_argument("--json", help="write the rows as JSON")


def _simulate(args) -> int:
    """The simulate command; bad input is one line on stderr and exit 2."""
    try:
        if args.png:
            _pyplot()  # refused before any replay
        return _run_simulation(args)
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 2


def _run_simulation(args) -> int:
    overrides = [parse_set(item) for item in args.set]
    if any(set(o) != {"residency"} for o in overrides):
        raise ValueError("--set takes residency.KEY=VALUE keys only")
    _refuse_unused(args)
    lanes = 1 if args.lanes is None else args.lanes
    if lanes < 1:
        raise ValueError(f"--lanes = {lanes}: must be >= 1")
    machine = _machine(args)
    if machine is None and (args.step_mib or args.lanes is not None):
        raise ValueError("--step-mib and --lanes shape the tok/s prediction: give "
                         "--expert-bytes, --hbm-gbps and --h2d-gbps (or --measure D,I)")
    if args.target_tps and machine is None:
        raise ValueError("--target-tps needs --expert-bytes, --hbm-gbps and --h2d-gbps, or "
                         "--measure")
    trace = history = None
    if args.trace:
        trace = simulate.read_trace(args.trace)
        settings = simulate.settings_of(trace.settings, overrides)
        n_layers, n_experts = trace.n_layers, trace.n_experts
    else:
        if not args.top_k or args.top_k < 1:
            raise ValueError("--history needs --top-k (the model's picks per token)")
        history = History.read(args.history)
        settings = simulate.settings_of({}, overrides)
        n_layers, n_experts = history.shape
    seed_map = args.seed_map or (settings.seed_map if trace else "")
    boot = seedmap.read(seed_map, n_layers, n_experts) if seed_map else np.zeros(0, np.int32)
    geometries = args.geometries or [settings.geometry]
    for geometry in geometries:
        if geometry not in ("per_layer", "arena"):
            raise ValueError(f"--geometries: {geometry!r} (per_layer or arena)")
    total = n_layers * n_experts
    host_budgets = _host_budgets(args.host_budgets, settings, total)
    outcomes = {}

    def outcome(budget: int, geometry: str, host_budget: int) -> simulate.Outcome:
        key = budget, geometry, host_budget
        if key not in outcomes:
            section = dataclasses.replace(settings, geometry=geometry)
            outcomes[key] = (
                simulate.replay(trace, section, budget, lanes, boot, host_budget) if trace else
                simulate.steady_state(history, args.top_k, budget, geometry,
                                      settings.miss_policy, lanes, host_budget))
        return outcomes[key]

    asked = args.budgets or [round(n_layers * (1 + (n_experts - 1) * i / 7)) for i in range(8)
                             ] + ([trace.resident_slots] if trace and trace.resident_slots else [])
    rows = []
    for geometry in geometries:
        for host_budget in host_budgets:
            for budget in sorted({simulate.resolve_budget(b, n_layers, n_experts, geometry)
                                  for b in asked}):
                if not host_budget or budget < host_budget:  # the engine's rule (manager)
                    rows.append(_row(outcome(budget, geometry, host_budget), machine))
    if not rows:
        raise ValueError(f"--budgets {asked}: none below the host budgets {host_budgets} (the "
                         "host holds every bank expert and one more)")
    _print_table(rows, args, settings, seed_map, trace)
    if args.target_tps:
        for geometry in geometries:
            for host_budget in host_budgets:
                _print_target(args.target_tps, machine, outcome, geometry, host_budget,
                              n_layers, total)
    if args.json:
        write_atomic(args.json, json.dumps(rows, indent=1).encode())
    if args.png:
        _plot(rows, args.png, machine is not None)
    return 0


def _host_budgets(asked: list[int] | None, settings, total: int) -> list[int]:
    """The host budgets to replay (0: every expert in host memory), checked as the engine
    checks them."""
    budgets = asked if asked is not None else [settings.host_budget_experts]
    for budget in budgets:
        if not 0 <= budget <= total:
            raise ValueError(f"--host-budgets: {budget} must be in [0, {total}] (0: every "
                             "expert in host memory)")
        simulate.check_host_budget(budget % total, settings.miss_policy)
    return sorted({budget % total for budget in budgets})


def _print_target(target: float, machine, outcome, geometry: str, host_budget: int,
                  n_layers: int, total: int) -> None:
    """--target-tps's answer for one geometry and host budget: the smallest GPU budget (below
    the host budget) whose prediction reaches it."""
    step = n_layers if geometry == "per_layer" else 1
    budgets = list(range(step, (host_budget or total + 1), step))
    found = simulate.smallest_budget(
        target, lambda b: machine.decode_tps(outcome(b, geometry, host_budget)), budgets)
    where = f"{geometry}" + (f", {host_budget} experts in host memory" if host_budget else "")
    print(f"--target-tps {target:g} ({where}): " + (
        f"{found} experts resident" if found else
        f"not reached: {budgets[-1]} experts resident predict "
        f"{machine.decode_tps(outcome(budgets[-1], geometry, host_budget)):.1f} tok/s"))


def _refuse_unused(args) -> None:
    """A flag the chosen input would not read is refused, not ignored."""
    unused = {"--top-k": args.trace and args.top_k is not None,
              "--seed-map": args.history and args.seed_map,
              "--expert-format": args.expert_format and not args.measure}
    for flag, refused in unused.items():
        if refused:
            raise ValueError(f"{flag} does not apply here (--top-k: with --history; --seed-map: "
                             "with --trace; --expert-format: with --measure)")


def _machine(args) -> simulate.Machine | None:
    """The sizes and bandwidths the prediction uses: given, else measured (--measure); None
    where there are none (no tok/s)."""
    given = {"expert_bytes": args.expert_bytes, "hbm_gbps": args.hbm_gbps,
             "h2d_gbps": args.h2d_gbps, "host_gbps": args.host_gbps,
             "disk_gbps": args.disk_gbps}
    if args.measure:
        given = {**_measure(args.measure, args.expert_format or "bf16", given), **{
            key: value for key, value in given.items() if value}}
    if not (given["expert_bytes"] and given["hbm_gbps"] and given["h2d_gbps"]):
        if any(given.values()):
            raise ValueError("a prediction needs --expert-bytes, --hbm-gbps and --h2d-gbps "
                             "(or --measure D,I)")
        return None
    return simulate.Machine(step_bytes=args.step_mib * 2**20,
                            **{k: v or 0.0 for k, v in given.items()})


def _measure(dims: list[int], fmt: str, given: dict) -> dict:
    """Bandwidths measured here by bench/ (HBM read: bench.ceilings; host-to-device and the host
    kernel: bench.roofline's, over random experts of dims D, I)."""
    if len(dims) != 2 or min(dims) < 32 or any(d % 32 for d in dims):
        raise ValueError(f"--measure {dims}: expected D,I, multiples of 32")
    try:
        from bench import ceilings, cpu_experts, roofline
    except ImportError:
        raise ValueError("--measure runs the benchmarks of bench/: run it from the repository "
                         "root, or give the bandwidths") from None
    pool = cpu_experts.random_pool(fmt, 16, *dims)
    measured = {"expert_bytes": row_bytes(pool)}
    if not given["hbm_gbps"]:
        measured["hbm_gbps"] = ceilings.hbm_read_gbps(1 << 28)
    if not given["h2d_gbps"]:
        measured["h2d_gbps"] = roofline.h2d_gbps(pool)
    if not given["host_gbps"]:
        measured["host_gbps"] = roofline.host_kernel_gbps(pool, 8)
    if not given["disk_gbps"]:
        measured["disk_gbps"] = ceilings.disk_read_gbps(measured["expert_bytes"])
    print("measured: " + ", ".join(f"{k} {v:.4g}" for k, v in measured.items()))
    return measured


def _row(outcome: simulate.Outcome, machine: simulate.Machine | None) -> dict:
    row = {"budget": outcome.budget, "geometry": outcome.geometry,
           "host_budget": outcome.host_budget, "miss_policy": outcome.policy,
           "cold_share": outcome.cold_share, "decode_cold_share": outcome.decode_cold_share,
           "host_cold_share": outcome.host_cold_share,
           "swaps_per_1k_tokens": outcome.swaps_per_1k_tokens,
           "approx_weight_share": outcome.approx_weight_share,
           "host_picks": outcome.host_picks, "ring_copies": outcome.ring_copies,
           "ring_hits": outcome.ring_hits, "disk_reads": outcome.disk_reads}
    if machine is not None:
        row |= {"budget_gib": outcome.budget * machine.expert_bytes / 2**30,
                "pcie_bytes_per_token": outcome.pcie_bytes_per_token(machine.expert_bytes),
                "disk_bytes_per_token": outcome.disk_bytes_per_token(machine.expert_bytes),
                "decode_tps": machine.decode_tps(outcome)}
    return row


def _print_table(rows: list[dict], args, settings, seed_map: str, trace) -> None:
    source = (f"trace {args.trace} ({int(trace.tokens.sum())} tokens in {len(trace.tokens)} "
              f"steps)" if trace else f"history {args.history} (its steady state)")
    print(f"{source}; miss_policy {settings.miss_policy}, boot map: "
          f"{seed_map or 'the first slots of each group'}")
    if trace and trace.resident_slots:
        print(f"the recording engine ({trace.resident_slots} experts resident) measured a cold "
              f"share of {trace.measured_cold_share():.4f}")
    print("| budget | geometry | GiB | cold share | swaps / 1K tokens | PCIe bytes / token | "
          "approx. share | host budget | host cold share | disk bytes / token | decode tok/s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        cells = [row["budget"], row["geometry"], _cell(row, "budget_gib", "{:.3g}"),
                 f"{row['cold_share']:.4f}", f"{row['swaps_per_1k_tokens']:.2f}",
                 _cell(row, "pcie_bytes_per_token", "{:.4g}"),
                 f"{row['approx_weight_share']:.4f}", row["host_budget"] or "all",
                 f"{row['host_cold_share']:.4f}", _cell(row, "disk_bytes_per_token", "{:.4g}"),
                 _cell(row, "decode_tps", "{:.1f}")]
        print("| " + " | ".join(map(str, cells)) + " |")


def _cell(row: dict, key: str, form: str) -> str:
    """A table cell: the value, or "-" where there is no prediction (no bandwidths)."""
    return form.format(row[key]) if key in row else "-"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--png needs matplotlib, an optional extra: pip install "
                         "'tidejax[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _plot(rows: list[dict], path: str, with_tps: bool) -> None:
    """Cold share (left axis) and predicted decode tok/s (right) against the budget, a line
    each per geometry and host budget; written atomically."""
    plt = _pyplot()
    fig, cold_axis = plt.subplots(figsize=(8, 4))
    tps_axis = cold_axis.twinx() if with_tps else None
    for geometry, host in dict.fromkeys((row["geometry"], row["host_budget"]) for row in rows):
        mine = [row for row in rows if (row["geometry"], row["host_budget"]) == (geometry, host)]
        budgets = [row["budget"] for row in mine]
        name = geometry + (f", host {host}" if host else "")
        cold_axis.plot(budgets, [row["cold_share"] for row in mine], "o-",
                       label=f"cold share ({name})")
        if tps_axis is not None:
            tps_axis.plot(budgets, [row["decode_tps"] for row in mine], "s--",
                          label=f"decode tok/s ({name})")
    cold_axis.set_xlabel("resident experts (budget)")
    cold_axis.set_ylabel("cold share")
    handles, labels = cold_axis.get_legend_handles_labels()
    if tps_axis is not None:
        tps_axis.set_ylabel("predicted decode tok/s")
        more = tps_axis.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    cold_axis.legend(handles, labels, loc="center right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


if __name__ == "__main__":
    sys.exit(main())
