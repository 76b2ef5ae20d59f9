"""What a budget would give: a recorded routing trace replayed through the planner at other
budgets and geometries (or a demand history's steady state), and the decode speed predicted
from bandwidths (`python -m tidejax.residency simulate`; DESIGN.md "Simulating a budget").

The replay is the manager's loop (residency/manager.py) over recorded picks instead of a step:
each step applies up to max_swaps_per_step queued swaps at its start, its picks hit or miss the
map, every drain_every steps its counters join a History, and the drain is planned by
`planner.plan` one step later, as `after_step` finishes a drain. What the step does with a miss
(`ring`'s copies, `auto`'s host picks and threshold) and the host cache over the disk are
residency/replay.py's models. The prediction counts, per decode step, the bytes read from device
memory (the fixed `step_bytes` and each distinct resident expert wanted), the rows crossing PCIe
(swaps, `exact`'s distinct missed experts, the ring's fetches), the rows the host kernel streams
(`cpu`'s and `auto`'s host picks' distinct experts) and the rows read from disk.

The trace is the recorder's format (tidejax/residency/trace.py), read by its `read_trace` and
checked here against its header.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from tidejax.config import EngineConfig, ResidencySection
from tidejax.residency.history import History
from tidejax.residency import trace as trace_file
from tidejax.residency.manager import follow_cap
from tidejax.residency.planner import Swap, fit_rows, place, plan
from tidejax.residency.pool import layer_slots
from tidejax.residency.replay import HostTierModel, RingModel, exact_picks, weight_shares

# the [residency] keys a replay follows; a recorded trace brings its engine's
SETTINGS = ("geometry", "miss_policy", "ring_slots", "exact_weight", "exact_budget",
            "max_approx_share", "drain_every", "half_life", "hysteresis", "max_swaps_per_layer",
            "max_swaps_per_step", "adapt", "seed_map", "host_budget_experts")


@dataclasses.dataclass(frozen=True)
class Trace:
    """Recorded steps: tokens [S] routed by each, and their picks as pool rows (layer * E +
    expert) rows / weights [N, L, k] (record r's from tokens[:r].sum()); `every`: steps each
    record stands for; resident [N, L, k]: whether the engine had each pick's expert in a slot;
    settings: the [residency] table the engine ran with."""

    n_layers: int
    n_experts: int
    tokens: np.ndarray
    rows: np.ndarray
    weights: np.ndarray
    resident: np.ndarray
    every: int = 1
    settings: dict = dataclasses.field(default_factory=dict)
    resident_slots: int = 0  # the recording engine's bank (0: not said)

    def measured_cold_share(self, lanes: int = 0) -> float:
        """The share of the recorded picks the engine served by a miss (with `lanes`: of its
        decode steps', those routing at most `lanes` tokens)."""
        resident = self.resident
        if lanes:
            decode = np.repeat((self.tokens > 0) & (self.tokens <= lanes), self.tokens)
            resident = resident[decode]
        return float(1.0 - resident.mean()) if resident.size else 0.0

    def steps(self):
        """Each recorded step's picks: rows [T, L, k] and their weights [T, L, k] float32."""
        ends = np.cumsum(self.tokens)
        for start, end in zip(ends - self.tokens, ends):
            yield self.rows[start:end], self.weights[start:end]


def read_trace(folder: str | Path) -> Trace:
    """A routing trace folder as a Trace; a ValueError naming the file or field that is wrong."""
    folder = Path(folder)
    header, arrays = trace_file.read_trace(folder)
    n_layers, n_experts, k = header["n_layers"], header["n_experts"], header["top_k"]
    tokens, ids = arrays["tokens"].astype(np.int64), arrays["ids"]
    if not tokens.size:
        raise ValueError(f"{folder}: the trace has no recorded steps")
    if tokens.ndim != 1 or (tokens < 0).any():
        raise ValueError(f"{folder}: field 'tokens' should be counts [steps]")
    want = (int(tokens.sum()), n_layers, k)
    for name in ("ids", "weights", "resident"):
        if arrays[name].shape != want:
            raise ValueError(f"{folder}: field '{name}' has shape {arrays[name].shape}, "
                             f"expected {want} (tokens.sum(), n_layers, top_k)")
    if ids.min() < 0 or ids.max() >= n_experts:
        raise ValueError(f"{folder}: field 'ids' should be expert ids in [0, {n_experts})")
    rows = np.arange(n_layers, dtype=np.int32)[None, :, None] * n_experts + ids.astype(np.int32)
    settings = header.get("residency") if isinstance(header.get("residency"), dict) else {}
    slots = header.get("resident_slots")
    return Trace(n_layers, n_experts, tokens, rows, arrays["weights"].astype(np.float32),
                 arrays["resident"].astype(bool), header["trace_every_steps"], settings,
                 slots if type(slots) is int else 0)


def settings_of(recorded: dict, overrides: list[dict]) -> ResidencySection:
    """The [residency] keys a replay follows: the recorded engine's (SETTINGS of them), then
    each --set, checked as a profile's are (ConfigError naming the key)."""
    config = EngineConfig.from_dict(
        {"residency": {key: recorded[key] for key in SETTINGS if key in recorded}},
        source="the trace's header")
    for override in overrides:
        config = config.with_overrides(override, source="--set")
    section = config.residency
    if section.miss_policy == "ring" and section.ring_slots < 1:
        raise ValueError("residency.miss_policy = 'ring' needs residency.ring_slots > 0")
    return section


def check_host_budget(host_budget: int, policy: str) -> None:
    """A host budget (the disk tier) under `ring`, refused: the engine reads its misses on disk
    beside the steps (Residency._read_hot), which the replay does not model yet."""
    if host_budget and policy == "ring":
        raise ValueError(f"host budget {host_budget}: miss_policy 'ring' over the disk tier is "
                         "not replayed yet (exact, substitute, cpu or auto)")


def resolve_budget(budget: int, n_layers: int, n_experts: int, geometry: str) -> int:
    """Resident slots a budget of experts gives, as the engine rounds it (per_layer: a whole
    number a layer)."""
    total = n_layers * n_experts
    if not 0 < budget <= total:
        raise ValueError(f"budget {budget} must be in [1, {total}]")
    per = layer_slots(budget, n_layers, geometry, source="--budgets")
    return per * n_layers if per else budget


def ratio(part: float, whole: float) -> float:
    """part / whole, 0 where there is no whole (a replay of no steps)."""
    return part / whole if whole else 0.0


class Share:
    """A read-only attribute: one of an Outcome's fields over another (`ratio`)."""

    def __init__(self, part: str, whole: str):
        self.part, self.whole = part, whole

    def __get__(self, outcome, owner=None):
        if outcome is None:  # the class's attribute
            return self
        return ratio(getattr(outcome, self.part), getattr(outcome, self.whole))


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A replay's tallies. Over all steps: tokens, wanted picks, misses, swaps, rows copied over
    PCIe by `exact` (`fetched`) and fetched by the ring (`ring_fetched`), rows the ring wrote
    (`ring_copies`) and picks it served (`ring_hits`), picks the host computed (`host_picks`),
    routing weight served approximately and all routed (in serve.weight_shares), `auto`'s
    threshold at the end and the steps that lowered it, picks of rows on disk (`host_misses`)
    and rows read from disk (`disk_reads`), of them by the host prefetch (`disk_prefetches`);
    over its decode steps: their count, tokens, wanted picks and misses, the distinct experts
    read from the bank (`reads`), rows over PCIe in the step's path (`pcie`: fetched and swapped
    in) and beside it (`ring_pcie`), rows the host kernel streamed (`host`), rows read from disk
    in the step's path (`disk`: `exact`'s misses, the host kernel's picks) and beside it
    (`disk_background`: swaps' and the prefetch's)."""

    budget: int
    geometry: str
    policy: str
    tokens: float
    wanted: float
    misses: float
    swaps: float
    fetched: float
    decode_steps: float
    decode_tokens: float
    reads: float
    pcie: float
    host: float
    host_budget: int = 0  # experts in host memory (0: every expert)
    ring_fetched: float = 0.0
    ring_copies: float = 0.0
    ring_hits: float = 0.0
    host_picks: float = 0.0
    approx_weight: float = 0.0
    routed_weight: float = 0.0
    threshold: float = 0.0
    threshold_lowered: float = 0.0
    host_misses: float = 0.0
    disk_reads: float = 0.0
    disk_prefetches: float = 0.0
    ring_pcie: float = 0.0
    disk: float = 0.0
    disk_background: float = 0.0
    decode_wanted: float = 0.0
    decode_misses: float = 0.0

    # wanted picks served by a miss over all wanted picks; of the decode steps' (those the tok/s
    # prediction counts); of rows on disk (stats' host_cold_share_total); routing weight served
    # approximately over all routed (in serve.weight_shares)
    cold_share = Share("misses", "wanted")
    decode_cold_share = Share("decode_misses", "decode_wanted")
    host_cold_share = Share("host_misses", "wanted")
    approx_weight_share = Share("approx_weight", "routed_weight")

    @property
    def swaps_per_1k_tokens(self) -> float:
        return ratio(1000.0 * self.swaps, self.tokens)

    def pcie_bytes_per_token(self, expert_bytes: float) -> float:
        rows = self.fetched + self.swaps + self.ring_fetched
        return ratio(rows * expert_bytes, self.tokens)

    def disk_bytes_per_token(self, expert_bytes: float) -> float:
        return ratio(self.disk_reads * expert_bytes, self.tokens)


def replay(trace: Trace, section: ResidencySection, budget: int, lanes: int,
           boot_rows: np.ndarray, host_budget: int = 0) -> Outcome:
    """The trace's steps through the manager's loop at `budget` resident slots (resolved) in
    `section.geometry`, the map booted from `boot_rows` (busiest first; none: the first slots of
    each group, as the engine's boot without a map or history), the host holding `host_budget`
    experts (0: all; else the rest on disk, residency/hostcache.py). A step of at most `lanes`
    tokens is a decode step."""
    n_layers, n_experts, every = trace.n_layers, trace.n_experts, trace.every
    size = n_layers * n_experts
    geometry, policy = section.geometry, section.miss_policy
    slot_rows = place(boot_rows, budget, n_layers, n_experts, geometry)
    history = History(n_layers, n_experts, section.half_life)
    n = max(1, section.max_swaps_per_step)
    per_step = n * every
    ring = (RingModel(section.ring_slots, min(section.ring_slots, n))
            if policy == "ring" else None)
    host = HostTierModel(host_budget, slot_rows, size) if host_budget else None
    threshold, share_read_next = section.exact_weight, None  # "auto": a step's share lags one
    queue: list[Swap] = []
    drain = None  # (counts, weight sums, steps) started at a step's end, finished at the next's
    since_drain = 0
    counted = np.zeros((2, size))  # counts and weight sums since the last drain
    totals = dict.fromkeys(("tokens", "wanted", "misses", "swaps", "fetched", "decode_steps",
                            "decode_tokens", "reads", "pcie", "host", "ring_fetched",
                            "ring_copies", "ring_hits", "host_picks", "approx_weight",
                            "routed_weight", "threshold_lowered", "host_misses", "ring_pcie",
                            "disk", "disk_background", "decode_wanted", "decode_misses"), 0.0)
    for rows, weights in trace.steps():
        tokens = len(rows)
        background = 0
        if host is not None:  # next_batch: the reads landed since, then the swaps ready
            host.commit(history.demand.reshape(-1), slot_rows, {s.row for s in queue})
            ready = [s for s in queue if host.held[s.row]]
            waiting = [s for s in queue if not host.held[s.row]]
            background = host.read(s.row for s in waiting)
            batch, queue = ready[:per_step], ready[per_step:] + waiting
        else:
            batch, queue = queue[:per_step], queue[per_step:]
        for swap in batch:
            slot_rows[swap.slot] = swap.row
            if ring is not None:
                ring.leave(swap.row)
        draining = since_drain + every >= section.drain_every
        resident = np.zeros(size, bool)
        resident[slot_rows[slot_rows >= 0]] = True
        step = {"tokens": tokens, "swaps": len(batch), "routed_weight": tokens * n_layers}
        if ring is not None:
            step |= {"ring_copies": ring.start(resident, section.adapt),
                     "ring_fetched": len(ring.chosen)}
        held = resident if ring is None else resident | ring.held(size)
        miss = ~held[rows]  # [T, L, k]
        shares = weight_shares(weights)
        on_host = (miss if policy == "cpu" else
                   exact_picks(miss, shares, threshold, section.exact_budget) if policy == "auto"
                   else np.zeros_like(miss))
        approx = miss & ~on_host if policy != "exact" else np.zeros_like(miss)
        approx_rows = np.zeros(size, np.float32)
        np.add.at(approx_rows, rows[approx], shares[approx])
        missed = np.unique(rows[miss])  # distinct experts the step wants and misses
        # the rows the step reads from disk in its path: exact's misses, the host kernel's picks
        in_step = missed if policy == "exact" else np.unique(rows[on_host])
        disk_read = host.read_now(in_step) if host is not None else 0
        step |= {"wanted": miss.size, "misses": miss.sum(),
                 "fetched": len(missed) if policy == "exact" else 0,
                 "host_picks": on_host.sum(), "approx_weight": float(approx_rows.sum()),
                 "ring_hits": int((~miss & ~resident[rows]).sum()),
                 "host_misses": 0 if host is None else int((miss & ~host.held[rows]).sum())}
        if 0 < tokens <= lanes:
            step |= {"decode_steps": 1, "decode_tokens": tokens, "decode_wanted": miss.size,
                     "decode_misses": step["misses"],
                     "reads": bank_reads(rows, miss, approx, held, n_layers),
                     "pcie": step["fetched"] + len(batch),
                     "ring_pcie": step.get("ring_fetched", 0),
                     "host": len(np.unique(rows[on_host])), "disk": disk_read,
                     "disk_background": background}
        for key, value in step.items():
            totals[key] += value
        if ring is not None:
            ring.choose(held, approx_rows, section.adapt)
        if policy == "auto":  # after_step reads the tally of the step before this one
            if share_read_next is not None:
                threshold, lowered = follow_cap(threshold, share_read_next, section)
                totals["threshold_lowered"] += lowered
            share_read_next = float(approx_rows.sum()) / (tokens * n_layers) if tokens else None
        counts = np.bincount(rows.reshape(-1), minlength=size).astype(np.float64)
        counted += (counts, np.bincount(rows.reshape(-1), weights.reshape(-1), minlength=size))
        since_drain += every
        if drain is not None:
            history.add(*drain)
            drain = None
            if section.adapt:
                queue = plan(history.demand, slot_rows, geometry, section.hysteresis,
                             section.max_swaps_per_layer)
                if host is not None:  # the host prefetch at the plan (Residency._read_ahead)
                    ahead = host.prefetch(history.demand.reshape(-1), slot_rows,
                                          section.hysteresis)
                    totals["disk_background"] += ahead if 0 < tokens <= lanes else 0
        if draining:
            drain = (*counted.reshape(2, n_layers, n_experts), since_drain)
            counted, since_drain = np.zeros_like(counted), 0
    if share_read_next is not None:  # the engine's flush at rest reads the last step's tally
        threshold, lowered = follow_cap(threshold, share_read_next, section)
        totals["threshold_lowered"] += lowered
    return Outcome(budget, geometry, policy, host_budget=host_budget, threshold=threshold,
                   disk_reads=host.reads if host is not None else 0.0,
                   disk_prefetches=host.prefetches if host is not None else 0.0, **totals)


def bank_reads(rows: np.ndarray, miss: np.ndarray, substituted: np.ndarray, held: np.ndarray,
               n_layers: int) -> int:
    """Experts a step reads from the bank: each distinct held expert its picks want, and, per
    layer, one for each substituted pick up to the held experts not wanted (a substitute is an
    expert its token did not pick; exact for a step of one token, an upper bound for more: two
    tokens' substitutes may share an expert). rows, miss, substituted [T, L, k]; held [L * E]."""
    wanted = np.zeros(held.size, bool)
    wanted[rows[~miss]] = True
    unread = (held & ~wanted).reshape(n_layers, -1).sum(1)  # [L]
    return int(wanted.sum() + np.minimum(substituted.sum((0, 2)), unread).sum())


def steady_state(history: History, top_k: int, budget: int, geometry: str, policy: str,
                 lanes: int, host_budget: int = 0) -> Outcome:
    """A history's steady state at `budget` (resolved): the map the planner tends to
    (`fit_rows` of its demand) held still, so no swaps, and the host (with `host_budget`) holding
    the bank's experts and the busiest others; the cold shares from the history's counts, and one
    decode step of `lanes` tokens whose picks are drawn independently, each token picking expert
    e of a layer with chance top_k x its share of the layer's counts (the expected distinct
    experts it wants). `ring` and `auto` need a trace (their picks' weights, step by step)."""
    if policy in ("ring", "auto"):
        raise ValueError(f"miss_policy {policy!r} is simulated from a trace (--trace), not a "
                         "history's steady state")
    counts = history.counts  # [L_moe, E]
    bank = fit_rows(history.demand, budget, geometry)
    held = np.zeros(counts.size, bool)
    held[bank] = True
    in_host = np.ones(counts.size, bool)
    if host_budget:
        rest = np.argsort(-history.demand.reshape(-1), kind="stable")
        in_host = held.copy()
        in_host[rest[~held[rest]][:host_budget - len(bank)]] = True
    held, in_host = held.reshape(counts.shape), in_host.reshape(counts.shape)
    layer_picks = counts.sum(1, keepdims=True)
    chance = np.minimum(1.0, top_k * np.divide(counts, layer_picks, out=np.zeros_like(counts),
                                               where=layer_picks > 0))
    distinct = 1.0 - (1.0 - chance) ** lanes  # [L_moe, E]: each expert wanted by the step
    missed = float(distinct[~held].sum())
    fetched = missed if policy == "exact" else 0.0
    disk = float(distinct[~in_host].sum()) if policy in ("exact", "cpu") else 0.0
    # substitute: the step's expected missed picks, each read as another held expert (bank_reads)
    substituted = (lanes * top_k * np.divide(np.where(held, 0.0, counts).sum(1), layer_picks[:, 0],
                                             out=np.zeros(len(counts)), where=layer_picks[:, 0] > 0)
                   if policy == "substitute" else np.zeros(len(counts)))
    unread = np.where(held, 1.0 - distinct, 0.0).sum(1)  # [L_moe]
    reads = float(distinct[held].sum() + np.minimum(substituted, unread).sum())
    return Outcome(budget, geometry, policy, tokens=lanes, wanted=float(counts.sum()),
                   misses=float(counts[~held].sum()), swaps=0.0, fetched=fetched,
                   decode_steps=1.0, decode_tokens=lanes, reads=reads,
                   pcie=fetched, host=missed if policy == "cpu" else 0.0,
                   host_budget=host_budget, host_misses=float(counts[~in_host].sum()),
                   disk_reads=disk, disk=disk, host_picks=missed if policy == "cpu" else 0.0)


def step_seconds(device_bytes: float, pcie_bytes: float, host_bytes: float, hbm_gbps: float,
                 h2d_gbps: float, host_gbps: float = 0.0) -> float:
    """A step's time as its transfers one after another: bytes read from device memory at
    hbm_gbps, copied host-to-device at h2d_gbps, streamed by the host kernel at host_gbps (no
    host bytes: host_gbps unused)."""
    host = host_bytes / (host_gbps * 1e9) if host_bytes else 0.0
    return device_bytes / (hbm_gbps * 1e9) + pcie_bytes / (h2d_gbps * 1e9) + host


@dataclasses.dataclass(frozen=True)
class Machine:
    """expert_bytes: one expert row as held; step_bytes: what every decode step reads from device
    memory besides the routed experts (dense weights, KV cache); bandwidths in GB/s (disk: rows
    read from the disk tier)."""

    expert_bytes: float
    step_bytes: float
    hbm_gbps: float
    h2d_gbps: float
    host_gbps: float = 0.0
    disk_gbps: float = 0.0

    def decode_tps(self, outcome: Outcome) -> float:
        """Predicted decode tok/s: the outcome's decode tokens over its decode steps' time: the
        transfers in the steps' path one after another (step_seconds, then the disk reads in
        their path), the ring's fetches beside the device reads (the larger of the two counts), and
        the swaps' and the prefetch's disk reads beside the steps (the run takes at least their
        time)."""
        if not outcome.decode_steps:
            raise ValueError("no decode step to predict from (none routed at most --lanes "
                             "tokens)")
        if outcome.host and not self.host_gbps:
            raise ValueError(f"miss_policy {outcome.policy!r} computes misses on the host: give "
                             "--host-gbps or --measure")
        if (outcome.disk or outcome.disk_background) and not self.disk_gbps:
            raise ValueError("a host budget reads rows from disk: give --disk-gbps or --measure")
        row = self.expert_bytes
        device = (outcome.decode_steps * self.step_bytes + outcome.reads * row) / (
            self.hbm_gbps * 1e9)
        seconds = (max(device, outcome.ring_pcie * row / (self.h2d_gbps * 1e9))
                   + step_seconds(0.0, outcome.pcie * row, outcome.host * row, self.hbm_gbps,
                                  self.h2d_gbps, self.host_gbps))
        if self.disk_gbps:
            seconds = max(seconds + outcome.disk * row / (self.disk_gbps * 1e9),
                          outcome.disk_background * row / (self.disk_gbps * 1e9))
        return outcome.decode_tokens / seconds


def smallest_budget(target_tps: float, tps_at, budgets: list[int]) -> int | None:
    """The smallest of `budgets` (ascending) whose predicted tok/s `tps_at(budget)` reaches
    `target_tps`, by bisection (tok/s taken to grow with the budget); None where the largest
    does not."""
    lo, hi = -1, len(budgets) - 1
    if tps_at(budgets[hi]) < target_tps:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tps_at(budgets[mid]) >= target_tps:
            hi = mid
        else:
            lo = mid
    return budgets[hi]
