"""The residency manager: the host side of expert residency. It owns the host mirror of the map,
the demand history, the planner's queue, the ring, persistence and telemetry; it never holds the
expert state (the scheduler's DecodeState does) and never writes it itself.

Engine contract (one thread drives the steps):
    residency = Residency(pool_rows, n_layers, top_k, config.residency, kernel=..., max_tokens=...)
    experts = residency.take_state()          # the boot state, once: the caller owns it
    options = residency.options               # the MoE layers' static ServeOptions
    each jitted step:  batch = residency.next_batch()          # swaps, drain, ring on or off
                       outputs, experts, tallies = step(params, experts, batch, ...)  [donated;
                       the step applies the batch at its start: swap.apply_batch]
                       residency.after_step(tallies, n)        # n = real tokens in that step
    after reading a step's outputs, where its tallies should count now: residency.flush()
    between steps:     experts = residency.apply_swaps / move_to / reseed / drain(experts, ...)
                       (the same apply_batch, run alone)

after_step never waits for the device: a step's miss tally and a drain's counters start their way
to the host (copy_to_host_async) and are read at the next after_step, while the step queued
after them runs. So the cold share and the plan lag one step; flush() reads whatever is still on
its way. The ring's copies never wait for the host: the steps choose and copy them
(residency/ring.py), and their tallies only count them.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from pathlib import Path

import jax
import numpy as np

from tidejax.config import ResidencySection
from tidejax.contract import plain
from tidejax.errors import ConfigError
from tidejax.ops.dispatch import MHC_FRONT, MOE_PREFILL
from tidejax.residency import seedmap
from tidejax.residency.cpu import CpuExperts
from tidejax import parallel
from tidejax.residency.history import History
from tidejax.residency.hostcache import HostCache, disk_stats
from tidejax.residency.persist import resume_stats, save_stats
from tidejax.residency.planner import Swap, fit_rows, place, plan, slot_groups
from tidejax.residency.pool import (budget_slots, host_pool, host_slots, layer_slots,
                                    n_rows, row_bytes)
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import ExpertState, Picks, all_resident_state, build_state
from tidejax.residency.trace import TraceRecorder, trace_folder
from tidejax.residency.swap import SwapBatch, Tallies, apply_now

log = logging.getLogger("tidejax.residency")


class Residency:
    def __init__(self, pool_rows: dict | None, n_layers: int, top_k: int,
                 section: ResidencySection, *, kernel: str = "auto",
                 moe_prefill: str = MOE_PREFILL, mhc_front: str = MHC_FRONT,
                 scan_layers: bool = False,
                 swiglu_limit: float = 0.0,
                 swiglu_form: tuple[float, float] = (1.0, 0.0), max_tokens: int = 1,
                 window: int = 64, disk_rows=None, mtp_layers: int = 0):
        """pool_rows: bank-format dict of host arrays [n_layers * E, ...] (every routed expert:
        numpy, or already placed in host memory, as runtime.build.load_weights gives them); or
        None and `disk_rows` (residency.disk: the rows on disk, of which the host pool caches
        pool.host_slots: host_budget_experts, or host_budget_gib of rows); max_tokens: the most
        tokens one step sends through a MoE layer (sizes `exact`'s transient slots: min(E,
        max_tokens * top_k)); mtp_layers: how many of the n_layers, the last, are a model's MTP
        layers' (speculating: their experts served and counted as any layer's; the history
        records it: history.py)."""
        self.section = section
        self.mtp_layers = mtp_layers
        self.swiglu_form = swiglu_form  # (alpha, up_shift) of the experts' activation
        self.n_layers, self.top_k = n_layers, top_k
        layout = pool_rows if disk_rows is None else disk_rows.layout
        total = n_rows(layout)
        if total % n_layers:
            raise ValueError(f"expert pool has {total} rows, not a multiple of {n_layers} layers")
        self.n_experts = total // n_layers
        self.row_bytes = row_bytes(layout)
        slots = budget_slots(section.budget_experts, section.budget_gib, self.row_bytes, total)
        self.all_resident = slots >= total
        self.geometry = section.geometry
        if not self.all_resident:
            per = layer_slots(slots, n_layers, section.geometry)
            slots = per * n_layers if per else slots
        self.n_resident = slots
        policy = section.miss_policy
        if policy == "ring" and section.ring_slots <= 0 and not self.all_resident:
            raise ConfigError("[residency] miss_policy = 'ring' needs ring_slots > 0")
        self.n_ring = section.ring_slots if policy == "ring" and not self.all_resident else 0
        self.n_transient = (min(self.n_experts, max_tokens * top_k)
                            if policy == "exact" and not self.all_resident else 0)
        self.disk_rows = disk_rows
        self.cache: HostCache | None = None  # the host pool as a cache of disk_rows (at boot)
        self._hot: set[int] = set()  # `ring`'s misses on disk being read (kept when they land)
        # `ring`'s misses read from disk and held now -> the steps run when they landed: held
        # (pinned) until the two steps after (the one that chooses them, the one that fetches)
        self._landed_hot: dict[int, int] = {}
        # rows the host pool holds (every row but over the disk tier)
        self.host_capacity = host_slots(section, self.row_bytes, total)
        if disk_rows is not None:
            self._check_host_budget()
        self.state_dir = Path(section.state_dir) if section.state_dir else None
        self.history = None
        self.counters = collections.Counter()
        # wanted picks served by a miss since boot, per MoE layer (the MTP layer's last)
        self.misses_by_layer = np.zeros(n_layers, np.int64)
        if self.state_dir:
            self.history = History.resume(self.history_path, n_layers, self.n_experts,
                                          section.half_life, mtp_layers)
            self.counters = resume_stats(self.stats_path, expected=self.history is not None)
        self.save_failing = False  # whether the last save failed (one warning a streak)
        self.needs_calibration = False
        self.history = self.history or History(n_layers, self.n_experts, section.half_life,
                                               mtp_layers)
        self.frozen = not section.adapt
        self._queue: list[Swap] = []
        # per step: (misses, wanted picks, approximately served weight, routed weight)
        self._window = collections.deque(maxlen=window)
        self._tallies = collections.deque()  # (misses [L_moe, E] on its way to the host, tokens)
        self._drain = None  # (counts, weight_sums [L_moe, E] on their way to the host, steps)
        self._draining = False  # whether the batch just handed out drains
        self._since_drain = 0
        # the routing weight served approximately (substituted) and all routed weight, in
        # serve.weight_shares (one a token and MoE layer), since boot
        self.approx_weight = self.routed_weight = 0.0
        self.exact_weight = section.exact_weight  # "auto"'s threshold now (max_approx_share)
        # a swap batch's fixed length: a step's share of the queue
        self.batch_length = 0 if self.all_resident else max(1, section.max_swaps_per_step)
        self.cpu: CpuExperts | None = None  # the "cpu" policy's host pool (set at boot)
        # called with each batch applied between steps, before it runs (process 0's runner
        # sends it to its peers as a plan: tidejax.runtime.runner)
        self.on_apply = None
        self._in_flight = None  # the last step's (or batch's) Tallies: done when it is
        self.recorder: TraceRecorder | None = None  # routing traces (start_trace)
        self._trace_rows = 0  # the Picks buffer's rows (start_trace)
        self._state = self._boot(pool_rows)
        self.options = ServeOptions(miss_policy=policy, kernel=kernel, moe_prefill=moe_prefill,
                                    mhc_front=mhc_front, scan_layers=scan_layers,
                                    swiglu_limit=swiglu_limit,
                                    swiglu_alpha=swiglu_form[0], swiglu_up_shift=swiglu_form[1],
                                    count=section.count, all_resident=self.all_resident,
                                    cpu=self.cpu, exact_budget=section.exact_budget,
                                    disk=self.cache if policy == "exact" else None)

    def _check_host_budget(self) -> None:
        """The host cache's budget against the bank's (ConfigError)."""
        section, host = self.section, self.host_capacity
        key = (f"[residency] host_budget_gib = {section.host_budget_gib} ({host} experts)"
               if section.host_budget_gib else f"[residency] host_budget_experts = {host}")
        if self.all_resident:
            raise ConfigError(f"{key} holds fewer experts than the bank (every expert "
                              f"is resident on the device): set budget_experts or budget_gib")
        if host <= self.n_resident:
            raise ConfigError(f"{key}: the host holds every bank expert and room to read "
                              f"one more: more than the bank's {self.n_resident} experts")

    def take_state(self) -> ExpertState:
        """The boot state, handed to its owner once (Residency keeps no reference to it)."""
        state, self._state = self._state, None
        if state is None:
            raise RuntimeError("the residency boot state was already taken")
        return state

    @property
    def ring_per_step(self) -> int:
        """Rows a step copies into ring slots at most (residency/ring.py)."""
        return min(self.n_ring, max(1, self.section.max_swaps_per_step)) if self.n_ring else 0

    def start_trace(self, model: str, model_type: str, rows: int) -> None:
        """Routing traces on (section.trace_every_steps): the steps record their picks in an
        ExpertState.picks buffer of `rows` rows (the most tokens one step routes), which
        after_step hands to the recorder (residency/trace.py). Across processes every process
        runs the same step, buffer included, but only process 0 records: the picks are
        replicated, and a peer's Residency takes no after_step (the peer has no recorder)."""
        section = self.section
        self._trace_rows = rows
        self._state = self._with_picks(self._state)
        if jax.process_index() > 0:
            return
        header = dict(model=model, model_type=model_type, n_layers=self.n_layers,
                      n_experts=self.n_experts, top_k=self.top_k,
                      resident_slots=min(self.n_resident, self.n_layers * self.n_experts),
                      residency=dataclasses.asdict(section))
        self.recorder = TraceRecorder(trace_folder(self.state_dir), header,
                                      section.trace_every_steps,
                                      int(section.trace_max_mib * 2**20))
        log.info("residency: recording the routing of every %d-th step under %s (at most "
                 "%g MiB)", section.trace_every_steps, self.recorder.folder,
                 section.trace_max_mib)

    def _with_picks(self, state: ExpertState) -> ExpertState:
        """`state` with an empty Picks buffer where routing traces are on."""
        if not self._trace_rows:
            return state
        return state.replace(picks=parallel.replicated(
            Picks.empty(self._trace_rows, self.n_layers, self.top_k)))

    def close_trace(self) -> None:
        """Writes the routing trace's last records (Engine.close)."""
        if self.recorder is not None:
            self.recorder.close()

    # -- boot ------------------------------------------------------------------------------

    @property
    def history_path(self) -> Path:
        return self.state_dir / "history.npz"

    @property
    def stats_path(self) -> Path:
        return self.state_dir / "stats.json"

    def _boot(self, pool_rows: dict) -> ExpertState:
        """The first state: all resident, or the seed map, else the saved history's busiest
        experts, else the first slots of each group (then `needs_calibration` is True)."""
        if self.all_resident:
            self.slot_rows = np.arange(self.n_layers * self.n_experts, dtype=np.int32)
            self.version = 0
            return all_resident_state(pool_rows, self.n_layers)
        if self.section.seed_map:
            wanted = seedmap.read(self.section.seed_map, self.n_layers, self.n_experts,
                                  self.mtp_layers)
            source = self.section.seed_map
        elif self.history.steps:
            wanted = fit_rows(self.history.demand, self.n_resident, self.geometry)
            source = "the saved demand history"
        else:
            wanted, source = np.zeros(0, np.int32), "the first slots (no map, no history)"
            self.needs_calibration = True
        resident = place(wanted, self.n_resident, self.n_layers, self.n_experts, self.geometry)
        log.info("residency: %d of %d experts resident (%s), %d ring + %d transient slots; boot "
                 "map from %s", self.n_resident, self.n_layers * self.n_experts, self.geometry,
                 self.n_ring, self.n_transient, source)
        if self.disk_rows is not None:
            state = self._boot_cache(resident)
        else:
            pool = host_pool(pool_rows)
            self._host_experts(pool)
            state = build_state(pool, self.n_layers, resident, ring=self.n_ring,
                                ring_copies=self.ring_per_step, transient=self.n_transient)
        self.slot_rows = np.asarray(state.slot_rows).copy()
        self.version = 0
        self._slot_changed = np.zeros(len(self.slot_rows), np.int64)  # map version of last change
        self.boot_rows = self.slot_rows.copy()
        return state

    def _host_experts(self, pool: dict, cache: HostCache | None = None) -> None:
        """`cpu` and `auto`: the host kernel over the placed host pool (`cache`'s, over the
        disk tier), which computes the misses it is given (self.cpu)."""
        if self.section.miss_policy not in ("cpu", "auto"):
            return
        if not plain(pool, *self.swiglu_form):
            raise ConfigError(
                f"[residency] miss_policy = {self.section.miss_policy!r} computes misses "
                "on the host, whose kernel takes no expert biases and only silu(g) * u "
                "(this model's experts, gpt-oss's, have both): use 'exact', 'substitute' "
                "or 'ring'")
        self.cpu = CpuExperts(pool, self.n_experts, disk=cache)

    def _boot_cache(self, resident: np.ndarray) -> ExpertState:
        """The host cache at boot: the bank's rows, then (with a saved history) the busiest of
        the others up to the host budget; nothing else is read."""
        capacity = self.host_capacity
        held = [int(r) for r in resident if r >= 0]
        if self.history.steps:
            order = np.argsort(-self.history.demand.reshape(-1), kind="stable")
            rest = [int(r) for r in order if r not in set(held)]
            held += rest[:capacity - len(held)]
        self.cache = HostCache(self.disk_rows, capacity)
        self.cache.fill(held)
        self._host_experts(self.cache.pool, self.cache)
        log.info("residency: %d of %d experts in host memory, the rest read from the %s as "
                 "needed", capacity, self.n_layers * self.n_experts, self.disk_rows.where)
        self._set_host_map()
        return build_state(self.cache.pool, self.n_layers, resident, ring=self.n_ring,
                           ring_copies=self.ring_per_step, transient=self.n_transient,
                           host_slots=self._host_map)

    # -- between steps ---------------------------------------------------------------------

    def next_batch(self) -> SwapBatch:
        """The batch the next step applies at its start: up to max_swaps_per_step queued swaps,
        each checked against the map (stale ones rejected); whether it drains (every drain_every
        steps); whether the ring copies (not frozen). From here the host map holds the swaps as
        applied: the step that takes the batch applies them. Over the disk tier the rows read
        since are committed to host slots first, and a swap whose row is still on disk waits
        in the queue for its read (queued here)."""
        n = self.section.max_swaps_per_step
        ready = self._queue
        if self.cache is not None:
            self._commit()
            ready = [s for s in self._queue if self._host_map[s.row] >= 0]
            waiting = [s for s in self._queue if self._host_map[s.row] < 0]
            self.cache.request(s.row for s in waiting)
        queued, self._queue = ready[:n], ready[n:]
        if self.cache is not None:
            self._queue += waiting
        pairs = self._accept(queued, "swaps_applied")
        # the drain_every-th step since the last drain drains at its end
        self._draining = self.options.count and self._since_drain + 1 >= self.section.drain_every
        return SwapBatch.of(pairs, self.batch_length if pairs else 0, self._draining,
                            self.exact_weight, ring=not self.frozen, host_slots=self._batch_map())

    def _set_host_map(self) -> None:
        """The host cache's map as the batches carry it from here: on the devices (one
        process), or numpy where the mesh spans several processes (the plans carry the batches
        to the peers, whose caches follow it: follow_host)."""
        self._host_map = self.cache.slot_of
        mesh = self.cache.mesh
        self._device_map = (self._host_map if parallel.process_count(mesh) > 1
                            else parallel.replicated(self._host_map, mesh))

    def follow_host(self, slot_of, wait_steps) -> bool:
        """A peer: its host cache brought to process 0's map (HostCache.follow) before a batch
        carrying it applies; whether it changed."""
        if self.cache is None or slot_of is None or not self.cache.follow(slot_of, wait_steps):
            return False
        self._set_host_map()
        return True

    def _batch_map(self):
        """The host cache's map as the steps take it (None without a disk tier)."""
        return None if self.cache is None else self._device_map

    def _commit(self, protect=()) -> None:
        """The rows read from disk since into host slots (HostCache.commit), after the steps in
        flight; the map the next batches carry follows. `ring`'s misses read from disk
        (`_hot`) are protected while read; once held, they are pinned like the bank's rows
        until the ring has fetched them (`_ring_pending`): else, where demand ties (no drain
        yet), the next misses' reads landing evict exactly the rows the last step chose before
        the next step fetches them, and the ring never converges."""
        protect = set(protect) | {s.row for s in self._queue} | self._hot
        pinned = np.concatenate([self.slot_rows[:self.n_resident],
                                 np.fromiter(self._ring_pending(), np.int32)])
        if self.cache.commit(self.history.demand.reshape(-1), pinned, protect,
                             self._wait_in_flight):
            self._set_host_map()
        reading = self.cache.reading()
        steps = self.counters["steps"]
        for row in self._hot - reading:  # landed: held (to be fetched) or dropped
            if self._host_map[row] >= 0:
                self._landed_hot[row] = steps
        self._hot &= reading

    def _ring_pending(self) -> list[int]:
        """`ring`'s misses read from disk that the ring may not have fetched yet: held since
        fewer than two steps ran (a row held when step S's batch was taken is chosen at S's end
        and fetched at S + 1's start; a commit before S + 2 waits for S + 1 before it writes
        over a held row). The others are forgotten."""
        steps = self.counters["steps"]
        self._landed_hot = {r: s for r, s in self._landed_hot.items()
                            if steps < s + 2 and self._host_map[r] >= 0}
        return list(self._landed_hot)

    def _read_ahead(self) -> None:
        """Host prefetch, at a drain's plan: the rows on disk whose demand would earn them a
        host slot (HostCache.worth_reading, by the same history and hysteresis as the bank's
        plan) read while decoding goes on; committed by a later next_batch."""
        self.cache.prefetch(self.cache.worth_reading(
            self.history.demand.reshape(-1), self.slot_rows[:self.n_resident],
            self.section.hysteresis))

    def _read_hot(self, approx: np.ndarray, host_map: np.ndarray) -> None:
        """`ring` over the disk tier: a step's substituted misses of rows on disk, heaviest
        routing weight first, read into host memory off the step's path (the ring copies only
        rows held there: residency/ring.py)."""
        hot = np.nonzero((approx > 0) & (host_map < 0))[0]
        self._hot.update(self.cache.prefetch(hot[np.argsort(-approx[hot], kind="stable")]))

    def _wait_in_flight(self) -> None:
        if self._in_flight is not None:
            jax.block_until_ready(self._in_flight)

    def idle_batch(self) -> SwapBatch:
        """A batch that changes nothing (warm-up, lowering): no swaps, no drain, no ring copy."""
        return SwapBatch.of([], 0, exact_weight=self.exact_weight, host_slots=self._batch_map())

    def warmup_batches(self) -> list[SwapBatch]:
        """One idle batch of each length a step meets: 0 (most steps) and, where experts can
        swap, batch_length. A step whose batch has no swaps compiles without the swap loop: on
        the GPU a loop of dynamic trip count makes the host wait for the device to read it, and
        the next step's launches stop overlapping this one's (40-layer V3-family synthetic at
        65% resident: 15.4 ms a bare step with the loop in every step, 8.8 ms of kernels)."""
        return [self.idle_batch()] + ([SwapBatch.of([], self.batch_length,
                                                    exact_weight=self.exact_weight,
                                                    host_slots=self._batch_map())]
                                      if self.batch_length else [])

    def after_step(self, tallies: Tallies, tokens: int) -> None:
        """Per step, without waiting for the device: the step's miss tally starts for the host and
        the previous step's is read (cold share, ring hits and copies); where the step's batch
        drained, its counters start for the host, and the history
        update, persisting and planning follow at the next call. `tokens` = real tokens the step
        sent through each MoE layer."""
        if self.recorder is not None:
            self.recorder.after_step(self.counters["steps"], tallies.picks, self.version)
        self.counters["steps"] += 1
        self._since_drain += 1
        self._in_flight = tallies
        self._finish_drain()
        if self._draining:
            self._start_drain(tallies)
            self._draining = False
        if not self.all_resident and (self.options.count or self.options.miss_policy == "ring"):
            for tally in (tallies.misses, tallies.approx, tallies.ring_hits, tallies.ring_copies):
                tally.copy_to_host_async()
            self._tallies.append((tallies, tokens,
                                  None if self.cache is None else self._host_map))
            self._read_tallies(keep=1)

    def flush(self) -> None:
        """Reads the tallies and the drain still on their way (waits for their steps)."""
        self._read_tallies(keep=0)
        self._finish_drain()
        if self.recorder is not None:
            self.recorder.flush()

    def _read_tallies(self, keep: int) -> None:
        """Reads all but the newest `keep` step tallies into the cold share, the approximate
        share and the ring's counts ("auto"'s threshold)."""
        while len(self._tallies) > keep:
            tallies, tokens, host_map = self._tallies.popleft()
            new = np.asarray(tallies.misses, np.float64)  # [L_moe, E] the step's misses
            if host_map is not None:  # those of rows on disk when the step ran
                self.counters["host_misses"] += int(new.reshape(-1)[host_map < 0].sum())
                # and those found in host memory because a prefetch had read them
                self.counters["host_prefetch_hits"] += int(
                    new.reshape(-1)[(host_map >= 0) & self.cache.prefetched].sum())
            wanted, routed = tokens * self.top_k * self.n_layers, tokens * self.n_layers
            approx = np.asarray(tallies.approx, np.float64)  # [L_moe, E]
            approx_weight = float(approx.sum())
            if host_map is not None and self.n_ring and not self.frozen:
                self._read_hot(approx.reshape(-1), host_map)
            copies = int(tallies.ring_copies)
            self.counters["ring_hits"] += int(tallies.ring_hits)
            self.counters["ring_copies"] += copies
            self.counters["bytes_moved"] += copies * self.row_bytes
            self._window.append((new.sum(), wanted, approx_weight, routed))
            self.counters["misses"] += int(new.sum())
            self.misses_by_layer += new.sum(axis=1).astype(np.int64)
            self.counters["wanted"] += wanted
            self.approx_weight += approx_weight
            self.routed_weight += routed
            if self.options.miss_policy == "auto" and routed:
                self._follow_cap(approx_weight / routed)

    def _follow_cap(self, share: float) -> None:
        """"auto"'s threshold after a step whose approximately served share was `share`
        (follow_cap)."""
        self.exact_weight, lowered = follow_cap(self.exact_weight, share, self.section)
        self.counters["threshold_lowered"] += int(lowered)

    def drain(self, state: ExpertState) -> ExpertState:
        """Reads the device counters into the history (decayed), zeroes them, persists, plans;
        now, waiting for the device."""
        self.flush()
        state, tallies = self._apply_now(state, SwapBatch.of([], 0, drain=True,
                                                             host_slots=self._batch_map()))
        self._start_drain(tallies)
        self._finish_drain()
        return state

    def _start_drain(self, tallies: Tallies) -> None:
        """Starts the counters a batch drained (in the Tallies) toward the host."""
        tallies.counts.copy_to_host_async()
        tallies.weight_sums.copy_to_host_async()
        self._drain = (tallies.counts, tallies.weight_sums, self._since_drain)
        self._since_drain = 0

    def _finish_drain(self) -> None:
        """The drain started last, if any: its counters into the history, persist, plan."""
        if self._drain is None:
            return
        counts, weights, steps = self._drain
        self._drain = None
        with jax.profiler.TraceAnnotation("drain"):
            t0 = time.perf_counter()
            self.history.add(np.asarray(counts), np.asarray(weights), steps)
            self.counters["drains"] += 1
            if not self.frozen and not self.all_resident:
                with jax.profiler.TraceAnnotation("plan"):
                    self._queue = [Swap(s.slot, s.row, self.version) for s in plan(
                        self.history.demand, self.slot_rows[:self.n_resident], self.geometry,
                        self.section.hysteresis, self.section.max_swaps_per_layer)]
                self.counters["planned"] += len(self._queue)
                if self.cache is not None:
                    self._read_ahead()
            self.counters["drain_seconds_x1e6"] += int((time.perf_counter() - t0) * 1e6)
            if self.state_dir:
                self._persist()

    # -- swaps -----------------------------------------------------------------------------

    def _accept(self, swaps: list[Swap], kind: str) -> list[tuple[int, int]]:
        """The (slot, row) pairs of `swaps` that still apply, with the host map updated as if
        they were applied: a swap is stale (rejected, counted) if its slot moved since its plan
        or its row became resident meanwhile. (A row in a ring slot leaves it on the device:
        swap._swap.)"""
        if not swaps:
            return []
        with jax.profiler.TraceAnnotation("swap"):
            t0 = time.perf_counter()
            accepted = []
            for swap in swaps:
                if (self._slot_changed[swap.slot] > swap.version
                        or swap.row in self.slot_rows[:self.n_resident]):
                    self.counters["swaps_rejected"] += 1
                    continue
                self.version += 1
                self.slot_rows[swap.slot] = swap.row
                self._slot_changed[swap.slot] = self.version
                accepted.append((swap.slot, swap.row))
            self.counters[kind] += len(accepted)
            self.counters["bytes_moved"] += len(accepted) * self.row_bytes
            self.counters["swap_seconds_x1e6"] += int((time.perf_counter() - t0) * 1e6)
        return accepted

    def apply_swaps(self, state: ExpertState, swaps: list[Swap]) -> ExpertState:
        """Applies swaps now, between steps (stale ones rejected and counted), a batch at a time
        through the function the steps apply their batches with; for tools and tests."""
        if self.all_resident:
            raise ValueError("every expert is resident: there is nothing to swap")
        pairs = self._accept(swaps, "swaps_applied")
        step = self.batch_length
        if self.cache is not None:  # the host holds the bank and this many rows besides
            step = min(step, self.cache.capacity - self.n_resident)
        for start in range(0, len(pairs), step):
            chunk = pairs[start:start + step]
            if self.cache is not None:
                self._bring([row for _, row in chunk])
            state, _ = self._apply_now(state, SwapBatch.of(chunk, self.batch_length,
                                                           host_slots=self._batch_map()))
        return state

    def _bring(self, rows: list[int]) -> None:
        """Reads `rows` into host memory now, waiting (between steps)."""
        self.cache.request(rows)
        self.cache.wait(rows)
        self._landed_hot.clear()  # the swaps' rows first: a ring row unfetched is read again
        self._commit(protect=rows)
        missing = [r for r in rows if self._host_map[r] < 0]
        if missing:
            raise RuntimeError(f"rows {missing[:4]} did not fit the host cache")

    def _apply_now(self, state: ExpertState, batch: SwapBatch) -> tuple[ExpertState, Tallies]:
        if self.on_apply is not None:
            self.on_apply(batch)
        state, tallies = apply_now(state, batch)
        self._in_flight = tallies
        return state, tallies

    def reseed(self, state: ExpertState) -> ExpertState:
        """Drains the counters (e.g. of a calibration prefill) and moves the whole resident set to
        the history's busiest experts, ignoring the caps (boot time, not the decode path)."""
        if self.all_resident:
            return state
        frozen, self.frozen = self.frozen, True  # drain without planning
        state = self.drain(state)
        self.frozen = frozen
        target = place(fit_rows(self.history.demand, self.n_resident, self.geometry),
                       self.n_resident, self.n_layers, self.n_experts, self.geometry)
        self.needs_calibration = False
        return self.move_to(state, target)

    def move_to(self, state: ExpertState, target: np.ndarray) -> ExpertState:
        """Swaps until each group of resident slots (a layer's, or the arena) holds the rows that
        `target` [resident] puts there; rows already in the group keep their slots."""
        target = np.asarray(target)[:self.n_resident]
        swaps = []
        for slots in slot_groups(self.n_resident, self.n_layers, self.geometry):
            want = set(target[slots][target[slots] >= 0].tolist())
            have = set(self.slot_rows[slots].tolist())
            free = [s for s in slots if self.slot_rows[s] not in want]
            swaps += [Swap(int(s), r, self.version) for s, r in zip(free, sorted(want - have))]
        return self.apply_swaps(state, swaps)

    def rebuild(self, rows: dict) -> ExpertState:
        """A fresh expert state after a failed step, from `rows` (ExpertState.rows: the host
        pool, or the bank where every expert is resident, which no step donates) and the host
        map: each resident slot holds what the map says (the swaps handed to the failed steps
        included), ring slots start empty with nothing to copy, counters at zero. What those
        steps had on its way to the host (miss tallies, a drain) is dropped."""
        self._tallies.clear()
        self._drain, self._draining, self._since_drain = None, False, 0
        self.counters["rebuilds"] += 1
        if self.all_resident:
            return self._with_picks(all_resident_state(rows, self.n_layers))
        return self._with_picks(build_state(
            rows, self.n_layers, self.slot_rows[:self.n_resident], ring=self.n_ring,
            ring_copies=self.ring_per_step, transient=self.n_transient,
            host_slots=None if self.cache is None else self._host_map))

    # -- control and telemetry -------------------------------------------------------------

    def freeze(self) -> None:
        """Stops adaptation (planner, queued swaps, ring copies); counting goes on."""
        self.frozen = True
        self._queue.clear()

    def unfreeze(self) -> None:
        self.frozen = False

    def save(self) -> None:
        """Persists the demand history and the stats (atomically) and writes a telemetry line;
        an OSError goes to the caller (a drain's own save only logs it: `_persist`)."""
        if not self.state_dir:
            raise ValueError("[residency] state_dir is not set: nothing to save to")
        self.history.save(self.history_path)
        save_stats(self.stats_path, self.counters)
        with open(self.state_dir / "telemetry.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), **self.stats()}) + "\n")

    def _persist(self) -> None:
        """`save` at a drain, which never fails a step: a failure is logged once a streak (a
        warning at the first, a line when saving works again) and retried at the next drain."""
        try:
            self.save()
        except OSError as e:
            self.counters["save_failures"] += 1
            if not self.save_failing:
                log.warning("residency: could not save the history and stats under %s (%s); "
                            "serving goes on, retrying at every drain", self.state_dir, e)
            self.save_failing = True
            return
        if self.save_failing:
            log.info("residency: saved under %s again", self.state_dir)
        self.save_failing = False

    def window_cold_share(self) -> float:
        """Cold share over the sliding window of recent steps."""
        return self._window_share(0, 1)

    def window_approx_share(self) -> float:
        """The share of routing weight served approximately over the window of recent steps."""
        return self._window_share(2, 3)

    def _window_share(self, part: int, whole: int) -> float:
        """sum of field `part` / sum of field `whole` over the window (safe from other threads:
        the window is copied in one step before it is read)."""
        window = tuple(self._window)
        total = sum(w[whole] for w in window)
        return sum(w[part] for w in window) / total if total else 0.0

    def approx_tally(self) -> tuple[float, float]:
        """(routing weight served approximately, all routing weight) since boot, in
        weight_shares (one a token and MoE layer); tallies read so far (a step lags)."""
        return self.approx_weight, self.routed_weight

    def cpu_picks(self) -> int:
        """Picks computed on the host CPU since boot (miss policy "cpu"; counted as the callbacks
        run, so a step still in flight may be missing)."""
        return self.cpu.picks if self.cpu else 0

    def _disk_stats(self) -> dict:
        """The disk tier's reads (HostCache.stats), zeros without one."""
        if self.cache is not None:
            return self.cache.stats()
        return disk_stats(collections.Counter(), held=self.n_layers * self.n_experts)

    def expert_map(self) -> tuple[np.ndarray, np.ndarray]:
        """(demand, resident): the decayed demand [L_moe, E] float64 (History.demand: routing
        weight) and the resident set [L_moe, E] bool (a slot of the host map's resident region
        holds the expert), copies: the dashboard's heatmap. Safe from other threads (each read
        is one copy)."""
        held = np.asarray(self.slot_rows[:self.n_resident]).copy()
        resident = np.zeros(self.n_layers * self.n_experts, bool)
        resident[held[held >= 0]] = True
        return (np.array(self.history.demand, np.float64),
                resident.reshape(self.n_layers, self.n_experts))

    def stats(self) -> dict:
        c = self.counters
        last = self._window[-1] if self._window else (0, 0, 0.0, 0)
        return {
            "steps": c["steps"],
            "cold_share_step": last[0] / last[1] if last[1] else 0.0,
            "cold_share_window": self.window_cold_share(),
            "cold_share_total": c["misses"] / c["wanted"] if c["wanted"] else 0.0,
            # wanted picks of experts in neither the bank nor host memory (the disk tier's)
            "host_cold_share_total": c["host_misses"] / c["wanted"] if c["wanted"] else 0.0,
            "host_misses": c["host_misses"],
            # wanted picks missing the bank that a host prefetch had brought into host memory
            "host_prefetch_hits": c["host_prefetch_hits"],
            "window_steps": len(self._window),
            "misses": c["misses"],
            "hits": c["wanted"] - c["misses"],
            "cpu_picks": self.cpu_picks(),
            # of those, picks of rows on disk when their step ran (read inside it: the disk tier)
            "cpu_disk_picks": self.cpu.disk_picks if self.cpu else 0,
            # routing weight served approximately (substituted) / all routed weight
            "approx_weight_share_step": last[2] / last[3] if last[3] else 0.0,
            "approx_weight_share_window": self.window_approx_share(),
            "approx_weight_share_total": (self.approx_weight / self.routed_weight
                                          if self.routed_weight else 0.0),
            "exact_weight": self.exact_weight,  # "auto"'s threshold now
            "threshold_lowered": c["threshold_lowered"],
            "cpu_kernel": self.cpu.isa if self.cpu else "",  # its path: avx512 | avx2 | ...
            "wanted": c["wanted"],
            "swaps_planned": c["planned"],
            "swaps_applied": c["swaps_applied"],
            "swaps_rejected": c["swaps_rejected"],
            "ring_copies": c["ring_copies"],  # rows the steps copied into ring slots
            "ring_hits": c["ring_hits"],  # wanted picks served from ring slots
            "swaps_queued": len(self._queue),
            "bytes_moved": c["bytes_moved"],
            "swap_seconds": c["swap_seconds_x1e6"] / 1e6,  # host time batching swaps
            "drains": c["drains"],
            "drain_seconds": c["drain_seconds_x1e6"] / 1e6,
            "save_failures": c["save_failures"],
            "rebuilds": c["rebuilds"],
            "resident": self.n_resident,
            "host_resident": (self.cache.capacity if self.cache else
                              self.n_layers * self.n_experts),
            **self._disk_stats(),
            "experts": self.n_layers * self.n_experts,
            "geometry": self.geometry,
            "miss_policy": self.options.miss_policy,
            "frozen": self.frozen,
            "map_version": self.version,
        }


def follow_cap(threshold: float, share: float, section: ResidencySection) -> tuple[float, bool]:
    """"auto"'s threshold after a step whose approximately served share of routing weight was
    `share`: 10% lower after a step above max_approx_share, 10% higher (up to exact_weight)
    after one at or below it, so the share settles at about the cap. A threshold below
    exact_weight moves more misses to the host (within exact_budget). -> (threshold, whether it
    was lowered)."""
    if share > section.max_approx_share:
        return threshold * 0.9, True
    return min(section.exact_weight, threshold / 0.9), False
