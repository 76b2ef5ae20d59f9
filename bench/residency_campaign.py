"""Residency campaign: the same traffic, shifting between domains, served three ways on one budget.

    python -m bench.residency_campaign [--model models/demo] [--fit-domain en]
        [--phases en,python,de,python] [--resident 0.65] [--requests 4] [--tokens 128]
        [--replay] [--png bench/campaign.png] [--quick] [--set table.key=value ...]

Variants (each a fresh `tidejax.load` with the same budget and miss policy):
  fixed     seed map fitted on --fit-domain, adaptation off (residency.adapt = false)
  adaptive  the same seed map, adaptation on: the resident set follows the traffic
  oracle    a seed map fitted on the traffic itself (all its phases' domains), adaptation off
Seed maps come from `python -m tidejax.residency fit` on the demand of the recorded routing
traces (bench/traces.py: the demo model's picks on held-out text of each domain).

Traffic: per phase, --requests requests whose prompts are held-out text of the phase's domain,
each decoding --tokens tokens (ignore_eos, temperature 0.6), all submitted at the phase start.
On the demo model the router routes by itself (real trained routing). With --replay (random-weight
synthetic models) each phase replays its domain's trace, scaled to the model.

Reports per variant and phase: median decode tok/s, cold share (missed / wanted picks), copies
(expert rows swapped or ring-copied into the bank),
and T90 after each shift: seconds until the cold share (smoothed over 16 steps) has cleared 90% of
its excess over the level the phase settles to (its last quarter); "-" when there was no excess
(< 0.05) to clear. Draws the cold share over decode steps (the same traffic, so the phases line
up) for the three variants to a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import traces
from bench.roofline import (drive, moe_dims, parse_set, prompt_ids,
                            residency_stats, seed_map_from_picks, warm_up)

VARIANTS = ("fixed", "adaptive", "oracle")
SMOOTH = 16  # steps


@dataclasses.dataclass
class Phase:
    domain: str
    tok_s: float
    cold: float
    copies: int
    t90: float | None


@dataclasses.dataclass
class Series:
    """Per decode step: seconds since the campaign started, cold share, the phase's index."""
    t: list[float] = dataclasses.field(default_factory=list)
    cold: list[float] = dataclasses.field(default_factory=list)
    phase: list[int] = dataclasses.field(default_factory=list)


def smooth(values: list[float], width: int = SMOOTH) -> np.ndarray:
    v = np.asarray(values, np.float64)
    if len(v) == 0:
        return v
    c = np.cumsum(np.concatenate([[0.0], v]))
    lo = np.maximum(np.arange(1, len(v) + 1) - width, 0)
    return (c[1:] - c[lo]) / (np.arange(1, len(v) + 1) - lo)


def t90(t: list[float], cold: list[float]) -> float | None:
    """Seconds from a phase's start until its smoothed cold share clears 90% of the excess over
    the level it settles to; None when the excess is under 0.05."""
    if len(cold) < 2 * SMOOTH:
        return None
    s = smooth(cold)
    settled = float(np.mean(cold[-max(len(cold) // 4, 1):]))
    excess = float(s[:SMOOTH].max()) - settled
    if excess < 0.05:
        return None
    start = int(np.argmax(s[:SMOOTH]))
    below = np.nonzero(s[start:] <= settled + 0.1 * excess)[0]
    return t[start + below[0]] - t[0] if len(below) else t[-1] - t[0]


def fitted_picks(domains: list[str], n_layers: int, n_experts: int, top_k: int, replay: bool):
    """The recorded picks of `domains`, concatenated (scaled to the model when replaying)."""
    picks = [traces.load(d) for d in domains]
    if replay:
        picks = [traces.scale(p, n_layers, n_experts, top_k) for p in picks]
    return np.concatenate(picks)


def run_variant(name: str, args, seed_map: Path, overrides: dict, replays: dict | None):
    import tidejax

    tables = {k: dict(v) for k, v in overrides.items()}
    tables.setdefault("residency", {}).update(
        budget_experts=args.budget, seed_map=str(seed_map), adapt=name == "adaptive")
    # every prompt's routing is the demand under study: none skipped by the prompt cache
    tables.setdefault("cache", {}).setdefault("enabled", False)
    engine = tidejax.load(args.model, **tables)
    warm = replays[args.phases[0]] if replays else None
    engine.set_routing_replay(warm)
    warm_up(engine, args.phases[0], args.prompt_tokens, args.requests)
    series, phases = Series(), []
    origin = time.perf_counter()
    for index, domain in enumerate(args.phases):
        if replays:
            engine.set_routing_replay(replays[domain])
        before = residency_stats(engine)
        start = len(series.t)
        prompts = [prompt_ids(engine, domain, args.prompt_tokens, offset=1009 * (index * 7 + i))
                   for i in range(args.requests)]
        rates = []

        def on_step(record, domain_index=index, rates=rates):
            if record.prefill or record.active == 0:
                return
            series.t.append(time.perf_counter() - origin)
            series.cold.append(record.cold)
            series.phase.append(domain_index)
            rates.append(record.active / record.seconds)

        drive(engine, prompts, args.tokens, on_step=on_step)
        after = residency_stats(engine)
        wanted = after["wanted"] - before["wanted"]
        phases.append(Phase(
            domain, statistics.median(rates) if rates else 0.0,
            (after["misses"] - before["misses"]) / wanted if wanted else 0.0,
            after["copies"] - before["copies"],
            t90(series.t[start:], series.cold[start:]) if index else None))
        print(f"[{name}] phase {index} {domain}: {phases[-1].tok_s:.1f} tok/s, cold "
              f"{phases[-1].cold:.3f}, copies {phases[-1].copies}", flush=True)
    return phases, series


def table(results: dict) -> str:
    lines = ["| variant | phase | domain | median tok/s | cold share | copies | T90 s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, (phases, _) in results.items():
        for i, p in enumerate(phases):
            lines.append(f"| {name} | {i} | {p.domain} | {p.tok_s:.1f} | {p.cold:.3f} | "
                         f"{p.copies} | {'-' if p.t90 is None else f'{p.t90:.1f}'} |")
    return "\n".join(lines)


# -- the picture ----------------------------------------------------------------------------------

COLORS = {"fixed": (214, 39, 40), "adaptive": (31, 119, 180), "oracle": (44, 160, 44)}


def draw(results: dict, path: Path, title: str) -> None:
    """Cold share over decode steps for each variant (matplotlib where installed, else a plain PNG
    of the lines, colours as COLORS, shifts as grey verticals)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _draw_plain(results, path)
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, (_, s) in results.items():
        ax.plot(smooth(s.cold), label=name, color=[c / 255 for c in COLORS[name]])
    _, first = next(iter(results.values()))
    for i in range(1, len(first.phase)):
        if first.phase[i] != first.phase[i - 1]:
            ax.axvline(i, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("decode step")
    ax.set_ylabel(f"cold share ({SMOOTH}-step mean)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _draw_plain(results: dict, path: Path, width: int = 800, height: int = 300) -> None:
    import struct
    import zlib

    pixels = bytearray(b"\xff" * (width * height * 3))

    def put(x, y, rgb):
        if 0 <= x < width and 0 <= y < height:
            pixels[(y * width + x) * 3:(y * width + x) * 3 + 3] = bytes(rgb)

    n_max = max(len(s.cold) for _, s in results.values()) or 1
    c_max = max(max(smooth(s.cold), default=0.0) for _, s in results.values()) or 1.0

    def xy(step, c):
        return int(step / n_max * (width - 1)), int((1 - c / c_max) * (height - 11)) + 5

    _, first = next(iter(results.values()))
    for i in range(1, len(first.phase)):
        if first.phase[i] != first.phase[i - 1]:
            for y in range(0, height, 2):
                put(xy(i, 0)[0], y, (160, 160, 160))
    for name, (_, s) in results.items():
        points = [xy(i, c) for i, c in enumerate(smooth(s.cold))]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            n = max(abs(x1 - x0), abs(y1 - y0), 1)
            for k in range(n + 1):
                put(x0 + (x1 - x0) * k // n, y0 + (y1 - y0) * k // n, COLORS[name])
    rows = b"".join(b"\x00" + bytes(pixels[y * width * 3:(y + 1) * width * 3]) for y in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(rows, 6)) + chunk(b"IEND", b""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(traces.REPO / "models" / "demo"))
    parser.add_argument("--fit-domain", default="en", help="the fixed map's domain")
    parser.add_argument("--phases", default="en,python,de,python", help="traffic domains in order")
    parser.add_argument("--resident", type=float, default=0.65, help="share of experts resident")
    parser.add_argument("--requests", type=int, default=4, help="requests per phase")
    parser.add_argument("--tokens", type=int, default=128, help="decoded tokens per request")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--replay", action="store_true", help="route by the phase's trace")
    parser.add_argument("--png", type=Path, default=None, help="cold share plot (default $OUT or "
                        "bench/campaign.png)")
    parser.add_argument("--quick", action="store_true",
                        help="small CPU run: 2 phases, 2 requests of 24 tokens, drains every 8 steps")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    args = parser.parse_args(argv)
    overrides = parse_set(args.set)
    if args.quick:
        args.phases, args.requests, args.tokens = "en,python", 2, 24
        for key, value in (("drain_every", 8), ("half_life", 50.0)):
            overrides.setdefault("residency", {}).setdefault(key, value)
        overrides.setdefault("engine", {}).setdefault("lanes", 2)
    args.phases = args.phases.split(",")
    n_layers, n_experts, top_k = moe_dims(args.model)
    args.budget = int(round(args.resident * n_layers * n_experts))
    replays = ({d: traces.scale(traces.load(d), n_layers, n_experts, top_k) for d in set(args.phases)}
               if args.replay else None)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    png = args.png or ((out or traces.REPO / "bench") / "campaign.png")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        overrides.setdefault("engine", {}).setdefault("compile_cache", str(Path(tmp) / "jax-cache"))
        maps = {
            "fit": seed_map_from_picks(fitted_picks([args.fit_domain], n_layers, n_experts, top_k,
                                                    args.replay), n_experts, args.budget,
                                       Path(tmp) / "fit.json"),
            "oracle": seed_map_from_picks(fitted_picks(args.phases, n_layers, n_experts, top_k,
                                                       args.replay), n_experts, args.budget,
                                          Path(tmp) / "oracle.json"),
        }
        for name in VARIANTS:
            results[name] = run_variant(name, args, maps["oracle" if name == "oracle" else "fit"],
                                        overrides, replays)
    title = (f"{Path(args.model).name}: {args.resident:.0%} resident ({args.budget} experts), "
             f"phases {' > '.join(args.phases)}")
    draw(results, png, title)
    text = (f"{datetime.date.today()}: {title}; fixed/adaptive fitted on {args.fit_domain}\n\n"
            f"{table(results)}\n\ncold share over time: {png}\n")
    print("\n" + text)
    if out:
        (out / "campaign.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
