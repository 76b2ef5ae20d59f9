"""Prompt caching's turn 2: time to first token cold and served from the device, host and disk
tiers of the prompt cache (issue 32).

    python -m bench.prompt_cache MODEL_DIR [MODEL_DIR ...] [--shared 16384] [--new 500]
        [--tiers cold,device,host,disk] [--repeats 3] [--set table.key=value ...]

An agent-style conversation: turn 1 is a prompt of `--shared` tokens (system prompt, tools,
history), turn 2 the same tokens and `--new` more. Each case times a turn 2's first token
(bench.roofline.time_to_first_token: from submit to the first token, one generated):

- cold: a prompt of turn 2's length that shares no page with anything cached (token ids of its
  own) on the same warm engine: every token prefilled.
- device: turn 2 right after turn 1, whose pages are still in the device pool's prefix index.
- host: turn 1's pages evicted from the device pool into the host tier by the pool's own
  eviction: the pool holds one sequence of turn 2's length (`engine.kv_pool_tokens` =
  `engine.max_context`), so the cold prompt, run after turn 1, takes every page and the pool
  spills the conversation's to host memory; a turn 2 with other new tokens matches them there.
- disk: the engine closed (Engine.close writes the device pool's indexed pages and the host
  tier to the disk tier under `cache.disk_dir`) and a new engine loaded over the same folder:
  only the disk tier holds the conversation. Its files are dropped from the OS page cache
  (posix_fadvise DONTNEED) before the timed request, so the restore reads the disk.

Each case's turn 2 has new tokens of its own, so each matches turn 1's pages alone. Which tier
served a case is the engine's own count over the request: the prompt tokens it matched per tier
(Scheduler.cache_stats) and the tokens its steps prefilled (Scheduler.totals).

Compiling is kept out of every figure: each engine (the first, and the one after the restart)
runs the whole sequence on conversations of their own token ids, two to warm up, then
`--repeats` measured; a case's row is its run of median TTFT among those. The first compiles
every step shape, sequence copy (the spills' reads) and page restore the sequence meets; each
later one starts from the pool the one before it left, so from the second on the same shapes
come again (each conversation's seconds are printed). Engine.warmup is not run: it compiles
every shape up to max_context.
Prints progress lines, then a markdown table (also written to $OUT/prompt_cache.md when $OUT
is set). The issue's target: a cached turn's TTFT at most 0.1x the cold one, and at most 0.5 s
from the device tier (the `target` column). `evicted` counts the device pool's pages the
request pushed out (each copied to the host tier, within its time, where that tier is on): the
cold and host cases run on a full pool, so their TTFT includes those copies, the device case's
none (the pool has turn 1 and room).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import tidejax
from bench.roofline import parse_set, report, time_to_first_token
from tidejax.config import EngineSection

CASES = ("cold", "device", "host", "disk")
TIERS = ("device", "host", "disk")
HEADER = ("| model | case | prompt tokens | cached tokens | from device | from host | from disk "
          "| prefilled | evicted | TTFT s | x cold | target |")


@dataclasses.dataclass
class Conversation:
    """Token ids of one conversation: turn 1 (the shared prefix), a new part for each case's
    turn 2 (device, host, disk) and a cold prompt of turn 2's length."""

    shared: list[int]
    new: dict[str, list[int]]
    cold: list[int]

    @classmethod
    def draw(cls, seed: int, shared: int, new: int, vocab: int) -> "Conversation":
        rng = np.random.default_rng(seed)

        def ids(n: int) -> list[int]:  # past the special ids; no page of one is another's
            return rng.integers(3, vocab, n).tolist()
        return cls(ids(shared), {tier: ids(new) for tier in TIERS}, ids(shared + new))

    def turn2(self, tier: str) -> list[int]:
        return self.shared + self.new[tier]


@dataclasses.dataclass
class Case:
    """One timed request: its TTFT and what served its prompt."""

    model: str
    case: str
    prompt: int
    ttft_s: float
    matched: dict[str, int]  # prompt tokens matched per tier
    prefilled: int
    evicted: int  # device pool pages pushed out during the request (spilled, with a host tier)

    def cells(self, cold: float | None) -> list[str]:
        ratio = self.ttft_s / cold if cold else None
        target = "" if self.case == "cold" or ratio is None else (
            "yes" if ratio <= 0.1 and (self.case != "device" or self.ttft_s <= 0.5) else "no")
        return [self.model, self.case, str(self.prompt), str(sum(self.matched.values()))] + [
            str(self.matched.get(tier, 0)) for tier in TIERS] + [
            str(self.prefilled), str(self.evicted), f"{self.ttft_s:.3f}",
            f"{ratio:.3f}" if ratio is not None else "", target]


def timed(engine, model: str, case: str, ids: list[int]) -> Case:
    """Turn 2's TTFT, with what the scheduler counted over the request: prompt tokens matched
    per tier, prefilled, and the device pool's pages evicted."""
    scheduler = engine.scheduler

    def counts() -> tuple[dict, int, int]:
        stats = scheduler.cache_stats()
        return ({tier: v["matched_tokens"] for tier, v in stats["tiers"].items()},
                scheduler.totals["prefilled_tokens"], stats["evictions"])
    matched, prefilled, evicted = counts()
    seconds = time_to_first_token(engine, ids)
    matched_after, prefilled_after, evicted_after = counts()
    return Case(model, case, len(ids), seconds,
                {tier: n - matched.get(tier, 0) for tier, n in matched_after.items()},
                prefilled_after - prefilled, evicted_after - evicted)


def drop_page_cache(folder: Path) -> None:
    """The OS page cache's copies of the files under `folder` dropped (written and fsynced, so
    clean: POSIX_FADV_DONTNEED lets them go), so a read of them goes to the disk."""
    for path in folder.rglob("*.page"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load(model: str, tables: dict, label: str):
    start = time.perf_counter()
    engine = tidejax.load(model, **tables)
    print(f"[{label}] loaded in {time.perf_counter() - start:.1f} s", flush=True)
    return engine


WARM_UPS = 2  # conversations run before the measured ones


def progress(i: int, conversations: list) -> str:
    return f"conversation {i} of {len(conversations)}" + (" (warm-up)" if i <= WARM_UPS else "")


def medians(rows: list[Case]) -> list[Case]:
    """Per case (in CASES order), the measured conversations' row of median TTFT."""
    out = []
    for case in CASES:
        runs = sorted((r for r in rows if r.case == case), key=lambda r: r.ttft_s)
        if runs:
            out.append(runs[len(runs) // 2])
    return out


def first_engine(engine, label: str, conversations: list[Conversation],
                 cases: list[str]) -> list[Case]:
    """Turn 1, then the device, cold and host cases, on each conversation (the cold prompt runs
    where host is wanted too: it evicts turn 1's pages to host memory); the measured ones'
    wanted cases."""
    measured = []
    for i, conversation in enumerate(conversations, 1):
        start = time.perf_counter()
        rows = []
        time_to_first_token(engine, conversation.shared)  # turn 1: its pages in the pool
        if "device" in cases:
            rows.append(timed(engine, label, "device", conversation.turn2("device")))
        if "cold" in cases or "host" in cases:
            rows.append(timed(engine, label, "cold", conversation.cold))
        if "host" in cases:
            rows.append(timed(engine, label, "host", conversation.turn2("host")))
        print(f"[{label}] {progress(i, conversations)}: " + ", ".join(
            f"{r.case} {r.ttft_s:.3f} s ({sum(r.matched.values())} cached)" for r in rows)
            + f"; {time.perf_counter() - start:.1f} s", flush=True)
        if i > WARM_UPS:
            measured += [r for r in rows if r.case in cases]
    return measured


def restarted(engine, label: str, conversations: list[Conversation],
              folder: Path) -> list[Case]:
    """The disk case on an engine loaded over the same folder after a restart: each
    conversation's turn 2 from disk, the files out of the page cache first; the measured
    ones'."""
    measured = []
    for i, conversation in enumerate(conversations, 1):
        drop_page_cache(folder)
        row = timed(engine, label, "disk", conversation.turn2("disk"))
        print(f"[{label} restarted] {progress(i, conversations)}: disk {row.ttft_s:.3f} s "
              f"({sum(row.matched.values())} cached)", flush=True)
        if i > WARM_UPS:
            measured.append(row)
    return measured


def engine_tables(overrides: dict, shared: int, new: int, workdir: Path) -> dict:
    """The profile's tables with --set's, and what the cases need unless --set says otherwise:
    one lane; a pool of one sequence of turn 2's length (and one token), so that the cold
    prompt evicts the conversation's pages; the prompt cache on, with room in host memory for
    every conversation's pages at the 40-layer shapes; its disk tier and the compile cache
    under `workdir`."""
    tables = {k: dict(v) for k, v in overrides.items()}
    engine = tables.setdefault("engine", {})
    engine.setdefault("lanes", 1)
    page = engine.get("page_size", EngineSection.page_size)
    engine.setdefault("max_context", -(-(shared + new + 1) // page) * page)
    engine.setdefault("kv_pool_tokens", engine["max_context"])
    engine.setdefault("compile_cache", str(workdir / "jax-cache"))
    cache = tables.setdefault("cache", {})
    cache.setdefault("enabled", True)
    cache.setdefault("host_gib", 16.0)
    cache.setdefault("disk_dir", str(workdir / "prompt-cache"))
    return tables


def run_model(model: str, args, overrides: dict, workdir: Path) -> list[Case]:
    """One model's cases: the first engine's, then the disk case after a restart."""
    tables = engine_tables(overrides, args.shared, args.new, workdir)
    label = Path(model).name
    engine = load(model, tables, label)
    vocab = engine.loaded.vocab_size
    conversations = [Conversation.draw(seed, args.shared, args.new, vocab)
                     for seed in range(1, 1 + WARM_UPS + args.repeats)]
    rows = first_engine(engine, label, conversations, args.tiers)
    engine.close()  # the device pool's and host tier's pages go to disk
    del engine
    gc.collect()  # the engine and its scheduler refer to each other: free the pool first
    if "disk" in args.tiers:
        engine = load(model, tables, f"{label} restarted")
        rows += restarted(engine, label, conversations, Path(tables["cache"]["disk_dir"]))
        engine.close()
        del engine
        gc.collect()
    return medians(rows)


def table(rows: list[Case]) -> str:
    colds = {r.model: r.ttft_s for r in rows if r.case == "cold"}
    return "\n".join([HEADER, "|" + " --- |" * 11]
                     + ["| " + " | ".join(r.cells(colds.get(r.model))) + " |" for r in rows])


def main(argv=None) -> list[Case]:
    logging.basicConfig(format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="+", help="checkpoint directories")
    parser.add_argument("--shared", type=int, default=16384, help="turn 1's prompt tokens")
    parser.add_argument("--new", type=int, default=500, help="tokens turn 2 adds")
    parser.add_argument("--tiers", default=",".join(CASES),
                        help="cases, comma-separated: " + ", ".join(CASES))
    parser.add_argument("--repeats", type=int, default=3,
                        help="measured conversations (after two that warm up); the median's row")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    args = parser.parse_args(argv)
    args.tiers = args.tiers.split(",")
    unknown = set(args.tiers) - set(CASES)
    if unknown:
        parser.error(f"--tiers: unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    overrides = parse_set(args.set)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rows = []
    for model in args.model:
        with tempfile.TemporaryDirectory() as tmp:
            rows += run_model(model, args, overrides, Path(tmp))
    report("prompt_cache.md", f"turn 2 of {args.shared} shared + {args.new} new tokens, the "
           f"median of {args.repeats} conversations a case, jax {jax.__version__} on "
           f"{jax.devices()[0].device_kind}\n\n{table(rows)}\n")
    return rows


if __name__ == "__main__":
    main()
