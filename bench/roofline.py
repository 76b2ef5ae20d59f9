"""Decode roofline: tok/s measured in-process beside the limit that the bytes it must move set.

    python -m bench.roofline MODEL_DIR [--trace en] [--resident 1.0,0.65]
        [--policies exact,substitute,ring] [--host 1.0,0.5] [--lanes 1,4] [--tokens 256]
        [--ttft 8192] [--set table.key=value ...] [--ceiling-mib 1024]

Per step the engine must read: the dense weights (every param but the embedding table, once per
step whatever the batch), the KV cache up to each active lane's position, and each distinct
routed expert the step's tokens want, once per MoE layer. Resident experts come from the bank
(device memory), missed ones under `exact` from the host pool. The limit of a step is

    (dense + KV + resident expert bytes) / HBM read bandwidth (bench/ceilings.py)
        + (missed expert bytes + swapped-in bytes) / host-to-device bandwidth

with both bandwidths measured in the same run: a jitted `a + 1` over 1 GiB (bytes read + written)
and the residency's own in-step fetch (a data-dependent row of a pinned_host pool written into a
device bank) of expert-sized rows. Distinct experts per step come from the replayed routing
trace (bench/traces.py) when there is one; otherwise batch x top-k per layer (an upper bound).
DeepSeek-V4.1's Engram rows (read from host memory inside the step) are not in the byte count.

`--host` below 1 (with a resident share below 1) holds that share of the experts in host memory
and the rest on disk (residency.host_budget_experts: the disk tier), and measures the disk's raw
direct-read bandwidth over the tier's own files in the same run (`disk_gbps`: O_DIRECT reads of
rows at random offsets in the tier's threads); each row then gives the host tier's cold share
(wanted picks of rows on disk) beside the bank's. The issue-34 run: `--resident 1.0,0.25
--host 1.0,0.5 --trace ''` on the V4.1 synthetic, with and without `--router-skew`.

Each configuration (resident share x miss policy x host share) is a fresh `tidejax.load`; at a
share below 1 it boots from a seed map fitted (`python -m tidejax.residency fit`) on the replayed
trace, and adapts. Prints a markdown table, then per configuration the KV cache bytes a token of
context and the device memory in use, and writes them to $OUT/roofline.md when $OUT is set. Any
model family whose layers can replay recorded routing works (DeepSeek-V3 family, DeepSeek-V4.1).
"""

from __future__ import annotations

import argparse
import logging
import dataclasses
import datetime
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import cpu_experts, traces
from bench.ceilings import copy_gbps, hbm_read_gbps, median_seconds
from tidejax import config
from tidejax.errors import ConfigError
from tidejax.runtime.sampling import SamplingParams
from tidejax.residency import cpu
from tidejax.residency.simulate import step_seconds
from tidejax.runtime.scheduler import ErrorEvent, GenerationRequest, TokenEvent
from tidejax.runtime.steps import replay_windows

HELDOUT = traces.HELDOUT


# -- ceilings measured in the same run -------------------------------------------------------------

def h2d_gbps(bank: dict, rows: int = 16) -> float:
    """Host-to-device GB/s of the residency's in-step fetch: rows of `bank`'s shape from a host pool
    (pinned_host where the device has it), each written into a device bank slot inside one jit."""
    from tidejax.residency.pool import host_pool
    from tidejax.residency.state import fetch_row, write_row

    rng = np.random.default_rng(0)
    pool = host_pool({k: rng.integers(0, 256, (rows,) + v.shape[1:], dtype=np.uint8).view(v.dtype)
                      if v.dtype.itemsize == 1 else
                      rng.standard_normal((rows,) + v.shape[1:], np.float32).astype(v.dtype)
                      for k, v in bank.items()})
    scratch = {k: jnp.zeros((2,) + v.shape[1:], v.dtype) for k, v in bank.items()}

    @jax.jit
    def fetch_all(pool, scratch):
        return jax.lax.fori_loop(0, rows, lambda i, b: write_row(b, i % 2, fetch_row(pool, i)),
                                 scratch)

    seconds = median_seconds(lambda: jax.block_until_ready(fetch_all(pool, scratch)), reps=5)
    return rows * row_bytes(bank) / seconds / 1e9


def disk_gbps(rows, nbytes: int) -> float:
    """GB/s of O_DIRECT reads of row-sized spans at random aligned offsets of the disk tier's
    files (residency.disk: the checkpoint's, or the prepared copy), `nbytes` in all, in the
    tier's reading threads: the raw bandwidth its reads can reach."""
    import concurrent.futures

    from tidejax.checkpoint.direct import ALIGN, DirectFile, aligned
    from tidejax.residency.hostcache import READ_WORKERS
    from tidejax.residency.pool import row_bytes as layout_row_bytes

    files = [DirectFile(path) for path in rows.files.prints]
    span = aligned(layout_row_bytes(rows.layout))
    rng = np.random.default_rng(0)
    reads = []
    for _ in range(max(1, nbytes // span)):
        f = files[rng.integers(len(files))]
        size = f.path.stat().st_size
        if size >= span:
            reads.append((f, int(rng.integers(0, (size - span) // ALIGN + 1)) * ALIGN))
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(READ_WORKERS) as pool:
        list(pool.map(lambda r: r[0].read(r[1], span), reads))
    return len(reads) * span / (time.perf_counter() - start) / 1e9


def host_kernel_gbps(bank: dict, experts: int) -> float:
    """GB/s of the `cpu` policy's host kernel over `experts` distinct experts of `bank`'s shapes
    for one token (bench/cpu_experts.py, from a random pool larger than the caches)."""
    from tidejax.contract import bank_format
    from tidejax.pallas.bank import bank_dims

    _, d, inter = bank_dims(bank)
    fmt = "mxfp4" if bank_format(bank) == "mxfp4" else "bf16"
    return cpu_experts.host_gbps(cpu_experts.random_pool(fmt, 4 * experts, d, inter), experts, 1)


# -- bytes a step must move ------------------------------------------------------------------------

def row_bytes(bank: dict) -> int:
    """Bytes of one expert (all its matrices and scales) in the bank's format."""
    return sum(leaf.nbytes // leaf.shape[0] for leaf in jax.tree.leaves(bank))


def dense_bytes(engine) -> int:
    """Params read every step: all but the embedding table (a few rows of it per step)."""
    embed = engine.loaded.params.get("embed")
    return sum(leaf.nbytes for leaf in jax.tree.leaves(engine.loaded.params)) - (
        embed.nbytes if embed is not None else 0)


def distinct_experts(picks: np.ndarray | None, batch: int, n_experts: int, top_k: int,
                     n_layers: int, max_context: int, first: int = 0) -> float:
    """Mean distinct experts a step of `batch` lanes wants, summed over MoE layers: lane i holds
    the request admitted (first + i)-th since the replay was set (`first`: the engine's
    LoadedModel.replay_admitted before the batch's requests), whose token at position p routes
    by trace row (window + p) mod N, its window steps.replay_windows(first + i, max_context, N)
    as the scheduler gives it (RequestHandle.window), every lane at the same p, over p every
    batch-th row (as many steps as the trace has rows a step)."""
    if picks is None:
        return float(n_layers * min(batch * top_k, n_experts))
    n = len(picks)
    windows = replay_windows(first + np.arange(batch), max_context, n)
    rows = (np.arange(0, n - batch + 1, batch)[:, None] + windows) % n
    groups = picks[rows]  # [steps, batch, n_layers, k]
    wanted = np.zeros((len(rows), n_layers, n_experts), bool)
    s, _, l, _ = np.indices(groups.shape)
    wanted[s, l, groups] = True
    return float(wanted.sum(-1).mean(0).sum())


@dataclasses.dataclass(frozen=True)
class Limit:
    tokens_per_s: float
    device_bytes: float  # per step
    host_bytes: float  # per step


def step_limit(engine, batch: int, context: float, distinct: float, cold: float, policy: str,
               swapped_bytes_per_step: float, read: float, h2d: float,
               cpu_gbps: float = 0.0) -> Limit:
    """The roofline tok/s of a decode step of `batch` lanes at mean `context` positions; under
    `cpu` the missed experts are streamed by the host kernel at `cpu_gbps` instead of copied."""
    expert = row_bytes(engine.state.experts.bank)
    missed = cold * distinct if policy in ("exact", "cpu") else 0.0
    device = (dense_bytes(engine) + engine.cache_bytes_per_token() * context * batch
              + (distinct - missed) * expert)
    host = missed * expert + swapped_bytes_per_step
    on_host = missed * expert if policy == "cpu" else 0.0  # streamed by the host kernel
    seconds = step_seconds(device, host - on_host, on_host, read, h2d, cpu_gbps)
    return Limit(batch / seconds, device, host)


# -- driving the engine ----------------------------------------------------------------------------

def prompt_ids(engine, domain: str, n: int, offset: int = 0) -> list[int]:
    """`n` tokens of held-out text of `domain` (repeated if short), from token `offset`."""
    ids = engine.tokenizer.encode((HELDOUT / f"{domain}.txt").read_text())
    reps = (offset + n) // len(ids) + 1
    return (ids * reps)[offset:offset + n]


def residency_stats(engine) -> dict:
    """The residency's counters, with `copies` = planned swaps + ring copies (rows moved in)."""
    stats = engine.residency.stats()
    return stats | {"copies": stats["swaps_applied"] + stats["ring_copies"]}


@dataclasses.dataclass
class StepRecord:
    seconds: float
    active: int
    prefill: bool  # the step admitted a request (its prefill ran in it)
    cold: float  # cold share of the step's wanted picks
    copies: int  # rows copied into the bank so far: swaps + ring copies (cumulative)
    bytes_moved: int  # cumulative


def drive(engine, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.6,
          seed: int = 0, on_step=None) -> list[StepRecord]:
    """Submits the prompts (ignore_eos, so each decodes exactly max_new_tokens) and runs the
    scheduler to idle, one record per step. Errors from the engine raise."""
    errors = []

    def on_event(event):
        if isinstance(event, ErrorEvent):
            errors.append(event.message)
    for i, ids in enumerate(prompts):
        engine.scheduler.submit(GenerationRequest(
            ids, max_new_tokens, SamplingParams(temperature, seed=seed + i), ignore_eos=True),
            on_event)
    records = []
    while True:
        queued = engine.scheduler.queued
        start = time.perf_counter()
        more = engine.scheduler.step()
        seconds = time.perf_counter() - start
        stats = residency_stats(engine)
        records.append(StepRecord(seconds, engine.scheduler.active,
                                  engine.scheduler.queued < queued, stats["cold_share_step"],
                                  stats["copies"], stats["bytes_moved"]))
        if on_step:
            on_step(records[-1])
        if errors:
            raise RuntimeError(f"engine error: {errors[0]}")
        if not more:
            return records


def warm_up(engine, domain: str, prompt_tokens: int, lanes: int, drains: bool = True) -> float:
    """Runs what a measurement will run before its clock starts (engine.warmup has compiled the
    step shapes): the prompt's prefill and the decode step, with `drains` each also right after
    a between-step counter drain (a drain hands the step fresh, uncommitted counter arrays, which
    compiles it once more). Returns the seconds."""
    start = time.perf_counter()
    prompts = [prompt_ids(engine, domain, prompt_tokens, offset=7 * i) for i in range(lanes)]
    for drain_first in (False, True) if drains else (False,):
        if drain_first:
            engine.runner.update_experts(engine.residency.drain)
        for ids in prompts:
            engine.scheduler.submit(GenerationRequest(ids, 4, SamplingParams(0.6), ignore_eos=True),
                                    raise_errors)
        engine.scheduler.step()  # prefill (after a drain the second time) and a decode
        if drains:
            engine.runner.update_experts(engine.residency.drain)
        engine.scheduler.run_until_idle()  # decode (right after a drain)
    return time.perf_counter() - start


def raise_errors(event) -> None:
    """A request's on_event that turns the engine's error events into exceptions."""
    if isinstance(event, ErrorEvent):
        raise RuntimeError(f"engine error: {event.message}")


def time_to_first_token(engine, ids: list[int]) -> float:
    """Seconds from submit to the first token of a prompt (its prefill), one token generated."""
    first = []
    start = time.perf_counter()

    def on_event(event):
        if isinstance(event, TokenEvent) and not first:
            first.append(time.perf_counter() - start)
        elif isinstance(event, ErrorEvent):
            raise RuntimeError(event.message)
    engine.scheduler.submit(GenerationRequest(ids, 1, SamplingParams(0.6), ignore_eos=True),
                            on_event)
    engine.scheduler.run_until_idle()
    return first[0]


def seed_map_from_picks(picks: np.ndarray, n_experts: int, budget: int, path: Path,
                        geometry: str = "per_layer") -> Path:
    """A seed map fitted by `python -m tidejax.residency fit` on the demand of `picks`
    [N, L_moe, k] (written as a demand history first)."""
    from tidejax.residency.__main__ import main as residency_cli
    from tidejax.residency.history import History

    n_layers = picks.shape[1]
    counts = np.stack([np.bincount(picks[:, l].reshape(-1), minlength=n_experts)
                       for l in range(n_layers)]).astype(np.float64)
    history = History(n_layers, n_experts)
    history.add(counts, counts, len(picks))
    history_path = path.with_suffix(".history.npz")
    history.save(history_path)
    if residency_cli(["fit", "--history", str(history_path), "--budget", str(budget),
                      "--out", str(path), "--geometry", geometry]) != 0:
        raise RuntimeError(f"seed map fit failed for budget {budget}")
    return path


# -- the matrix ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    resident: float
    policy: str
    lanes: int
    tok_s: float
    limit: Limit
    cold: float
    copies: int
    ttft_s: float | None = None
    host: float = 1.0  # the share of the experts in host memory (the rest on disk)
    host_cold: float = 0.0  # the share of wanted picks of rows on disk

    def cells(self) -> list[str]:
        return [f"{self.resident:.0%}", self.policy, str(self.lanes), f"{self.tok_s:.1f}",
                f"{self.limit.tokens_per_s:.1f}", f"{self.tok_s / self.limit.tokens_per_s:.2f}",
                f"{self.limit.device_bytes / 1e9:.2f}", f"{self.limit.host_bytes / 1e9:.3f}",
                f"{self.cold:.3f}", str(self.copies),
                f"{self.ttft_s:.3f}" if self.ttft_s is not None else "",
                f"{self.host:.0%}", f"{self.host_cold:.3f}"]


PROMPT_TOKENS = 64  # prompt of each decode measurement
HEADER = ("| resident | policy | lanes | decode tok/s | limit tok/s | ratio | device GB/step | "
          "host GB/step | cold share | copies | TTFT s | in host | host cold share |")


def steady_decode(engine, lanes: int, tokens: int, domain: str,
                  on_step=None) -> tuple[list, list]:
    """Decodes `tokens` on each of `lanes` prompts of PROMPT_TOKENS (`on_step(record)` after each
    step, as drive's); returns (every step's record, the steady ones: every lane decoding, past
    the first two such steps)."""
    prompts = [prompt_ids(engine, domain, PROMPT_TOKENS, offset=997 * i) for i in range(lanes)]
    records = drive(engine, prompts, tokens, on_step=on_step)
    steady = [r for r in records if not r.prefill and r.active == lanes][2:]  # past compile/admit
    if not steady:
        raise RuntimeError(f"no full decode steps at {lanes} lanes ({len(records)} steps)")
    return records, steady


def measure_decode(engine, picks, lanes: int, tokens: int, domain: str, policy: str,
                   read: float, h2d: float, resident: float, cpu_gbps: float = 0.0,
                   host: float = 1.0) -> Row:
    before, first = residency_stats(engine), engine.loaded.replay_admitted
    records, steady = steady_decode(engine, lanes, tokens, domain)
    after = residency_stats(engine)
    step_s = statistics.median(r.seconds for r in steady)
    cold = statistics.mean(r.cold for r in steady)
    moved = (after["bytes_moved"] - before["bytes_moved"]) / len(records)
    n_moe, n_experts = engine.family.expert_dims(engine.cfg)[:2]
    top_k = engine.family.top_k(engine.cfg)
    distinct = distinct_experts(picks, lanes, n_experts, top_k, n_moe, engine.loaded.max_context,
                                first)
    limit = step_limit(engine, lanes, PROMPT_TOKENS + tokens / 2, distinct, cold, policy, moved,
                       read, h2d, cpu_gbps)
    wanted = after["wanted"] - before["wanted"]
    host_cold = (after["host_misses"] - before["host_misses"]) / wanted if wanted else 0.0
    return Row(resident, policy, lanes, lanes / step_s, limit, cold,
               after["copies"] - before["copies"], host=host, host_cold=host_cold)


def moe_dims(model: str) -> tuple[int, int, int]:
    """(MoE layers, routed experts a layer, experts a token picks) of a checkpoint, read by its
    model family (a V3 config keeps them at the top, a V4.1 one in text_config)."""
    from tidejax.fields import read_json
    from tidejax.models.registry import family_for

    path = Path(model) / "config.json"
    raw = read_json(path)  # a missing or malformed file: an error naming it
    family = family_for(raw, str(path))
    cfg = family.config_from_hf(raw, str(path))
    n_moe, n_experts = family.expert_dims(cfg)[:2]
    return n_moe, n_experts, family.top_k(cfg)


def memory_line(engine) -> str:
    """Cache bytes a token of context adds, and the device memory in use (where JAX reports it)."""
    stats = jax.devices()[0].memory_stats() or {}
    device = (f"device memory in use {stats['bytes_in_use'] / 2**30:.2f} GiB (peak "
              f"{stats.get('peak_bytes_in_use', 0) / 2**30:.2f} GiB)" if "bytes_in_use" in stats
              else "device memory: not reported")
    return f"KV cache {engine.cache_bytes_per_token():.0f} bytes a token of context; {device}"


def load_config(model: str, resident: float, policy: str | None, args, overrides: dict,
                workdir: Path, max_context: int, host: float = 1.0):
    """A fresh engine for one configuration (engine.lanes = the most of args.lanes; below
    `resident` 1, residency.budget_experts, the miss `policy` (None: the profile's) and a seed map
    fitted on the replayed args.trace; below `host` 1, residency.host_budget_experts, a prepared
    copy where one is needed under workdir), replaying the trace; returns (engine, picks)."""
    import tidejax

    n_moe, n_experts, top_k = moe_dims(model)
    picks = (traces.scale(traces.load(args.trace), n_moe, n_experts, top_k)
             if args.trace else None)
    tables = {k: dict(v) for k, v in overrides.items()}
    engine_table = tables.setdefault("engine", {})
    engine_table.setdefault("lanes", max(args.lanes))
    engine_table.setdefault("max_context", max_context)
    # cold prefill is what these benches time: a repeated prompt must not be served from the
    # prompt cache (issue 32's own bench times cached turns)
    tables.setdefault("cache", {}).setdefault("enabled", False)
    # every fresh load of the same shapes after the first reads its compiled steps
    engine_table.setdefault("compile_cache", str(workdir / "jax-cache"))
    res = tables.setdefault("residency", {})
    label = f"[{resident:.0%}{'' if policy is None else ' ' + policy}]"
    if resident < 1.0:
        budget = int(round(resident * n_moe * n_experts))
        res["budget_experts"] = budget
        if policy is not None:
            res["miss_policy"] = policy
        if policy == "ring":
            res.setdefault("ring_slots", max(8, n_experts // 16))
        if host < 1.0:
            res["host_budget_experts"] = max(budget + 1, int(round(host * n_moe * n_experts)))
            res.setdefault("state_dir", str(workdir / "state"))
            label = f"{label[:-1]}, {host:.0%} in host]"
        if picks is not None:
            res.setdefault("seed_map", str(seed_map_from_picks(
                picks, n_experts, budget, workdir / f"seed-{resident}-{policy}.json")))
    start = time.perf_counter()
    engine = tidejax.load(model, **tables)
    print(f"{label} loaded in {time.perf_counter() - start:.1f} s", flush=True)
    if picks is not None:
        engine.set_routing_replay(picks)
    return engine, picks


def run_config(engine, picks, resident: float, policy: str, args, read: float,
               h2d: float, cpu_gbps: float = 0.0, host: float = 1.0) -> list[Row]:
    drains = engine.config.residency.drain_every <= args.tokens + PROMPT_TOKENS
    start = time.perf_counter()
    engine.warmup()  # the server's: every step shape a request can meet
    print(f"[{resident:.0%} {policy}] engine warm-up {time.perf_counter() - start:.1f} s "
          f"({len(engine.loaded.warmup_shapes())} step shapes)", flush=True)
    seconds = warm_up(engine, args.domain, PROMPT_TOKENS, max(args.lanes), drains)
    print(f"[{resident:.0%} {policy}] warm-up (compile) {seconds:.1f} s", flush=True)
    rows = []
    for lanes in args.lanes:
        row = measure_decode(engine, picks, lanes, args.tokens, args.domain, policy, read, h2d,
                             resident, cpu_gbps, host)
        print("| " + " | ".join(row.cells()) + " |", flush=True)
        rows.append(row)
    if args.ttft and policy == "exact":  # the worst case: every miss copied in
        ids = prompt_ids(engine, args.domain, args.ttft)
        rows[0].ttft_s = time_to_first_token(engine, ids)  # the first such prompt since warm-up
        print(f"[{resident:.0%} {policy}] TTFT at {args.ttft} tokens: {rows[0].ttft_s:.2f} s, "
              f"{time_to_first_token(engine, ids):.2f} s repeated", flush=True)
    return rows


def report(name: str, text: str) -> None:
    """Prints a run's report and writes it to $OUT/name where $OUT is set (the device tool)."""
    print("\n" + text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], name).write_text(text)


def parse_set(items: list[str]) -> dict:
    """["engine.lanes=8", ...] -> {"engine": {"lanes": 8}}: the server's --set, merged."""
    tables: dict = {}
    for item in items:
        try:
            for table, values in config.parse_set(item).items():
                tables.setdefault(table, {}).update(values)
        except ConfigError as e:
            raise SystemExit(f"error: {e}") from None
    return tables


def main(argv=None) -> int:
    logging.basicConfig(format="%(message)s")
    logging.getLogger("tidejax.warmup").setLevel(logging.INFO)  # lowering and compile seconds
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="checkpoint directory")
    parser.add_argument("--trace", default="en", help="routing trace to replay ('' = the router's own)")
    parser.add_argument("--domain", default="en", help="held-out text for the prompts")
    parser.add_argument("--resident", default="1.0", help="resident shares, comma-separated")
    parser.add_argument("--policies", default="exact,substitute,ring")
    parser.add_argument("--host", default="1.0",
                        help="shares of the experts in host memory, the rest on disk (below 1 "
                             "with a resident share below 1), comma-separated")
    parser.add_argument("--lanes", default="1,4")
    parser.add_argument("--tokens", type=int, default=256, help="decoded tokens per request")
    parser.add_argument("--ttft", type=int, default=8192, help="prompt tokens for TTFT (0 = skip)")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    parser.add_argument("--ceiling-mib", type=int, default=1024,
                        help="bytes the read and copy ceilings stream (>= 1 GiB on a GPU)")
    args = parser.parse_args(argv)
    args.lanes = [int(x) for x in args.lanes.split(",")]
    overrides = parse_set(args.set)
    configs = [(share, policy, host) for share in (float(x) for x in args.resident.split(","))
               for policy in (args.policies.split(",") if share < 1.0 else ["exact"])
               for host in ([float(x) for x in args.host.split(",")] if share < 1.0 else [1.0])]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    ceiling_bytes = args.ceiling_mib << 20
    read, copy = hbm_read_gbps(ceiling_bytes), copy_gbps(ceiling_bytes)
    h2d, rows, memory = None, [], []
    cpu_gbps = 0.0  # the host kernel's rate, measured where a configuration runs `cpu`
    disk = 0.0  # the disk tier's raw direct reads, measured where a configuration has one
    with tempfile.TemporaryDirectory() as tmp:
        for share, policy, host in configs:
            engine, picks = load_config(args.model, share, policy, args, overrides, Path(tmp),
                                        max(args.ttft, 64 + args.tokens) + 64, host)
            if engine.residency.cache is not None and not disk:
                disk = disk_gbps(engine.residency.disk_rows, ceiling_bytes)
                print(f"disk direct reads {disk:.2f} GB/s ({engine.residency.disk_rows.where}, "
                      f"O_DIRECT {bool(engine.residency.disk_rows.direct)})", flush=True)
            if h2d is None:
                h2d = h2d_gbps(engine.state.experts.bank)
                print(f"HBM read {read:.0f} GB/s, device copy {copy:.0f} GB/s (read + write); "
                      f"host-to-device {h2d:.1f} GB/s "
                      f"(in-step expert fetch)", flush=True)
            if policy == "cpu" and not cpu_gbps:
                top_k = engine.family.top_k(engine.cfg)
                cpu_gbps = host_kernel_gbps(engine.state.experts.bank, top_k)
                print(f"host kernel {cpu_gbps:.1f} GB/s ({cpu.kernel_isa()}, {top_k} experts a "
                      "token)", flush=True)
            rows += run_config(engine, picks, share, policy, args, read, h2d, cpu_gbps, host)
            memory.append(f"- {share:.0%} {policy} {host:.0%} in host: {memory_line(engine)}")
            print(memory[-1], flush=True)
            del engine
            gc.collect()  # the engine and its scheduler refer to each other: free the pool and
            # the bank (pinned host and device memory) before the next configuration loads
    table = "\n".join([HEADER, "|" + " --- |" * 13]
                      + ["| " + " | ".join(r.cells()) + " |" for r in rows])
    text = (f"{datetime.date.today()}, jax {jax.__version__} on {jax.devices()[0].device_kind}: "
            f"HBM read {read:.0f} GB/s (the roofline's divisor), device copy {copy:.0f} GB/s, "
            f"host-to-device {h2d:.1f} GB/s"
            + (f", host kernel {cpu_gbps:.1f} GB/s ({cpu.kernel_isa()})" if cpu_gbps else "")
            + (f", disk direct reads {disk:.2f} GB/s" if disk else "")
            + f"\n\n{table}\n\n"
            "Memory after each configuration's runs (peak: since the process started):\n"
            + "\n".join(memory) + "\n")
    report("roofline.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
