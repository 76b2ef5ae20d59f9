"""The runner: the one owner of the DecodeState and the only caller of the jitted steps over it.

`Runner.run(StepPlan) -> StepResult` carries out what the scheduler decided (runtime/plan.py):
saves and restores of preempted sequences, the lanes' sampling rows, residency's between-step
swap batches, then the mixed step, a scoring forward or a warm-up step. The result stays on the
device until the scheduler reads it (`StepResult.tokens`): the step's sampled tokens start toward
the host as soon as it is queued, and a later plan's decoding lanes take them as input on the
device (`StepPlan.previous` names the step).

Tensor parallelism across processes: process 0's runner sends each plan to its peers before
carrying it out, so every process makes the same jitted calls in the same order (their
collectives pair the processes); a peer is a runner fed those plans (tidejax.distributed.peer).
The channel carries ("boot", slot_rows, host map) first (process 0's boot map and, over the disk
tier, its host cache's map, which a peer takes where its own history gave another), then
("plan", StepPlan) per plan, and ("stop",) last. Residency decides on process 0 alone: the swap
batches are in the plans, and the batches it applies between steps are sent as plans of their
own as they apply (`Residency.on_apply`). Over the disk tier each plan carries process 0's host
cache orders since the last (reads queued, rows dropped), which a peer's cache obeys, and each
batch the host map it was taken with, which a peer's cache holds before the batch applies
(HostCache.follow). A preempted sequence is
saved by every process, each its own copy (parallel.to_host: a process holds its shards of KV
pages split by heads) under the plan's number, so no pages cross the channel. So is the prompt
cache's host and disk tiers (kv/tiers.py): every runner keeps its own (`open_tiers`: on disk in a
folder of its process index), a spill puts each process's shards of a page under its block hash,
and a restore writes back as many pages as every process holds (`_restore` agrees the count);
each peer reports its tiers' counts back over the channel, for process 0's /metrics
(`tier_stats`).

While the scheduler's thread runs (`owner`), a call from another thread raises: it goes through
`Scheduler.call`, which runs it on that thread between two iterations.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from pathlib import Path

import jax
import numpy as np

from tidejax import parallel
from tidejax.kv.tiers import DiskTier, Spilled, Tiers, model_key
from tidejax.residency.swap import Tallies, apply_now
from tidejax.runtime.build import LoadedModel
from tidejax.runtime.plan import PageRestore, PageSpill, SequenceCopy, StepPlan
from tidejax.runtime.sampling import LaneParams, Sampled, SamplingParams
from tidejax.runtime.steps import DonatingStep, SavedSequence, VerifyInputs

log = logging.getLogger("tidejax.warmup")  # the warm-up's timing (bench.roofline prints it)
tiers_log = logging.getLogger("tidejax")


@dataclasses.dataclass
class StepResult:
    """What a plan gave back, still on the device where it came from a device call."""

    step: int | None = None  # the mixed step's number (a later plan's `previous`); None: none ran
    sampled: Sampled | None = None  # each lane's next token [lanes] and its logprobs
    tallies: Tallies | None = None  # for residency's after_step (step or scoring forward)
    logits: jax.Array | None = None  # the scoring forward's [1, T, vocab]
    # a verify step's drafts kept per lane [lanes] (its Sampled is [lanes, k + 1]); else None
    accepted: jax.Array | None = None
    saved: dict[int, SavedSequence] = dataclasses.field(default_factory=dict)  # copy -> read
    # the tier ("host", "disk") each prompt-cache page its restores wrote back came from, here
    restored: list[str] = dataclasses.field(default_factory=list)
    # the numbers (PageRestore.snapshots') of the restored pages' lane snapshots kept
    snapshots: list[int] = dataclasses.field(default_factory=list)

    def tokens(self) -> np.ndarray:
        """The step's tokens [lanes] ([lanes, k + 1] of a verify step; waits for the step)."""
        return np.asarray(self.sampled.tokens)

    def logprobs(self) -> Sampled:
        """The step's Sampled in host memory (waits for the step)."""
        return jax.device_get(self.sampled)

    def scores(self) -> np.ndarray:
        """The scoring forward's logits [T, vocab] float32, padding included (waits for it);
        whole on every device, so read here."""
        return np.asarray(self.logits, np.float32)[0]


def _in_scope(method):
    """`method` inside its model's scope (LoadedModel.scope: the model's mesh and compilation
    cache), as every call of the runner's that touches the device runs."""
    @functools.wraps(method)
    def scoped(self, *args, **kwargs):
        with self.model.scope():
            return method(self, *args, **kwargs)
    return scoped


class Runner:
    def __init__(self, model: LoadedModel, channel=None):
        """channel: process 0's tidejax.distributed channel to its peers, which get every plan;
        None in one process and on a peer."""
        self.model = model
        with model.scope():
            self.state = model.initial_state()  # the one DecodeState, donated into every step
            self.tiers = open_tiers(model, self.state)  # the prompt cache's host and disk tiers
            # the shardings of a page in pinned host memory where the host tier keeps its pages
            # there (one process; a backend without pinned_host: numpy), else None
            self.pinned = pinned_pages(model, self.state) if self.tiers is not None else None
        # saved sequences by their plan's number (a spill's read in pinned memory: a list of
        # pages, _read_pages)
        self.copies: dict[int, SavedSequence | list] = {}
        self.owner: threading.Thread | None = None  # the scheduler's thread while it runs
        self._steps = 0  # mixed steps run
        self.verify_steps = 0  # of them, verify steps (speculative decoding)
        # (number, tokens) of the last step; a verify step's: (number, steps.Latest)
        self.last: tuple[int, object] | None = None
        self.peers = channel
        # a peer (process_id > 0): its host cache follows the maps of process 0's batches
        self.follows = channel is None and jax.process_index() > 0
        cache = model.residency.cache
        if channel is not None:
            if cache is not None:
                cache.orders = []  # its reads and drops go to the peers in the plans
            model.residency.on_apply = lambda batch: self._send("plan", StepPlan(experts=[batch]))
            self._send("boot", model.residency.slot_rows,
                       None if cache is None else cache.slot_of)

    # -- plans -----------------------------------------------------------------------------

    @_in_scope
    def run(self, plan: StepPlan) -> StepResult:
        """Carries out `plan` in its order (runtime/plan.py); queues its device call and returns
        without waiting for it."""
        self._own()
        self._send("plan", plan)
        if self.follows and self.model.residency.cache is not None:
            self.model.residency.cache.obey(plan.host_orders)
        result = StepResult()
        spilled = {spill.copy for spill in plan.spills} if self.pinned is not None else set()
        for read in plan.reads:
            result.saved[read.copy] = self.copies[read.copy] = (
                self._read_pages(read.pages) if read.copy in spilled else self._read(read))
        for spill in plan.spills:
            self._spill(spill)
        for copy in plan.forget:
            self.copies.pop(copy, None)
        for lane, params in plan.lanes.items():
            self._set_lane(lane, params, plan.seen.get(lane, ()))
        for restore in plan.restores:
            self._restore(restore, result)
        for write in plan.writes:
            if write.copy not in self.copies:
                raise ValueError(f"no saved copy {write.copy} to write back (each goes back "
                                 "once, but a kept one)")
            self._write(write, self.copies[write.copy] if write.keep
                        else self.copies.pop(write.copy))
        for batch in plan.experts:
            self._follow(batch)
            self.state = self.state.replace(experts=apply_now(self.state.experts, batch)[0])
        self._follow(plan.swaps)
        if plan.steps:
            self._step(plan, result)
        elif plan.score is not None:
            inputs, _ = self.model.score_inputs(plan.score, plan.swaps)
            result.logits, self.state, result.tallies = self.model.steps.score(
                self.model.step_params, self.state, inputs)
        elif plan.warmup is not None:
            self.dispatch(self.model.warmup_inputs(*plan.warmup, plan.swaps))
        return result

    def _step(self, plan: StepPlan, result: StepResult) -> None:
        previous = None
        if plan.previous is not None:
            if self.last is None or self.last[0] != plan.previous:
                raise ValueError(f"a step's previous tokens must be the last step's output "
                                 f"(step {plan.previous} is not the last)")
            previous = self.last[1]
        if plan.verify:
            inputs = self.model.verify_inputs(plan.decode, plan.prefill, previous, plan.swaps)
        else:
            inputs = self.model.step_inputs(plan.decode, plan.prefill, previous, plan.swaps)
        with jax.profiler.TraceAnnotation("decode" if plan.prefill is None else "prefill"):
            sampled, tallies = self.dispatch(inputs)
        latest = None
        if plan.verify:  # the next verify step's inputs stay on the device
            sampled, result.accepted, latest = sampled
        early = jax.tree.leaves(sampled) if plan.logprobs else [sampled.tokens]
        for leaf in early + ([result.accepted] if plan.verify else []):
            leaf.copy_to_host_async()  # on its way as soon as the step ends
        self._steps += 1
        self.verify_steps += plan.verify
        self.last = (self._steps, sampled.tokens if latest is None else latest)
        result.step, result.sampled, result.tallies = self._steps, sampled, tallies

    def _read(self, read: SequenceCopy) -> SavedSequence:
        """What a preempted sequence keeps until it resumes, in host memory: its pages of the KV
        pool, its lane's rows (DeepSeek-V4.1's Engram look-back among them) and token counts
        (numpy leaves; across processes each keeps its own shards of a leaf split over them)."""
        saved = parallel.to_host(self.model.steps.read_sequence(
            self.state, np.asarray(read.pages, np.int32), np.int32(read.lane)))
        return dataclasses.replace(saved, copy=read.copy)

    def _write(self, write: SequenceCopy, saved: SavedSequence) -> None:
        """Puts a read back: into the pool at `write.pages` and the rows of `write.lane` (any
        lane: not necessarily the one it was read from)."""
        cache, sampling = self.model.steps.write_sequence(
            self.state.cache, self.state.sampling, np.asarray(write.pages, np.int32),
            np.int32(write.lane), parallel.from_host(saved))
        self.state = self.state.replace(cache=cache, sampling=sampling)

    def _read_pages(self, pages: tuple[int, ...]) -> list:
        """A spill's read where the host tier is pinned: each of the pool's `pages` on its way to
        pinned host memory (a copy from the device each, started and not waited for)."""
        rows = self.model.steps.read_pages(self.state.cache.pages, np.asarray(pages, np.int32))
        return parallel.to_pinned(rows, self.pinned)

    def _spill(self, spill: PageSpill) -> None:
        """Each page of a read into the host tier under its block hash (this process's shards of
        it; in pinned host memory where `self.pinned`: _read_pages), with the lane snapshot kept
        with it; at close, the disk writes it pushed waited for."""
        if self.tiers is None:  # this process's tiers did not open (its log says why)
            return
        read = self.copies[spill.copy]
        for i, (digest, snapshot) in enumerate(zip(spill.digests, spill.snapshots, strict=True)):
            rows = read[i] if self.pinned is not None else jax.tree.map(
                lambda leaf: parallel.host_rows(leaf, i, i + 1), read.cache.pages)
            self.tiers.spill(digest, Spilled(rows, self.copies.get(snapshot)))
        if spill.closing and self.tiers.disk is not None:
            self.tiers.disk.flush()

    def _restore(self, restore: PageRestore, result: StepResult) -> None:
        """Writes prompt-cache pages back into the pool; `result` says the tier each came from
        and the lane snapshots kept. Every process loads its own entries, then they agree
        (parallel.agree_min) on the run every one of them holds, cut back to its last entry with
        a lane snapshot where snapshots are asked for, and on which of its entries have one
        (each kept under its number); entries loaded past the run go back to host memory."""
        held = np.zeros((2, self.model.max_pages), np.int32)  # [held, has a snapshot]
        if restore.copy is not None:  # the warm-up's: a kept copy's pages as they are, after
            # an agreement on nothing (across processes its jitted min compiles here)
            parallel.agree_min(held, self.model.mesh)
            if self.pinned is not None:  # the spill's read and the pinned write: page 0 as is
                self._write_pages(restore.pages, self._read_pages(restore.pages))
            else:
                self._write_pages(restore.pages, [self.copies[restore.copy].cache.pages])
            return
        loaded = self.tiers.load(list(restore.digests)) if self.tiers is not None else []
        held[0, :len(loaded)] = 1
        held[1, :len(loaded)] = [entry.snapshot is not None for _, _, entry in loaded]
        every, snapshots = parallel.agree_min(held, self.model.mesh)
        n = int(np.cumprod(every).sum())
        while restore.snapshots is not None and n and not snapshots[n - 1]:
            n -= 1
        for digest, _, entry in loaded[n:]:  # kept, not served
            self.tiers.spill(digest, entry)
        if self.tiers is not None:
            self.tiers.hits.update(tier for _, tier, _ in loaded[:n])
        if n:
            self._write_pages(restore.pages[:n], [entry.pages for _, _, entry in loaded[:n]])
        for i in range(n if restore.snapshots is not None else 0):
            if snapshots[i]:
                self.copies[restore.snapshots[i]] = loaded[i][2].snapshot
                result.snapshots.append(restore.snapshots[i])
        result.restored += [tier for _, tier, _ in loaded[:n]]

    def _write_pages(self, pages: tuple[int, ...], rows: list) -> None:
        """`rows` (Spilled.pages' trees) into the pool at `pages`; where the host tier is pinned,
        every page from pinned host memory (a disk entry's numpy leaves put there first)."""
        steps, at = self.model.steps, np.asarray(pages, np.int32)
        if self.pinned is None:
            pool = steps.write_pages(self.state.cache.pages, at, rows)
        else:
            pool = steps.write_pinned(self.state.cache.pages, at,
                                      parallel.to_pinned(rows, self.pinned))
        self.state = self.state.replace(cache=dataclasses.replace(self.state.cache, pages=pool))

    def close_tiers(self) -> None:
        """The host tier's pages (at close, the device pool's indexed pages among them:
        Scheduler.close_tiers) written to the disk tier and its writes waited for (Engine.close; a
        peer at stop): a restart over the same folder matches them. The tiers are off after."""
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None

    def tier_stats(self) -> dict[int, dict]:
        """{process index: its prompt cache tiers' Tiers.stats()}: this process's now and, on
        process 0, each peer's last report (sent after each plan that spilled or restored pages
        and at each ping: tidejax.distributed.peer); a process without tiers is left out."""
        out = {} if self.peers is None else self.peers.reports()
        tiers = self.tiers  # (None once closed: another thread may ask meanwhile)
        if tiers is not None:
            out[jax.process_index()] = tiers.stats()
        return dict(sorted(out.items()))

    def _set_lane(self, lane: int, params: SamplingParams, seen) -> None:
        """A lane's sampling row, its token counts cleared but for the token ids `seen` (a
        cached prefix's: no step of the lane runs them)."""
        row = np.zeros(self.model.vocab_size, bool)
        row[np.asarray(seen, np.int64)] = True
        self.state = self.state.replace(sampling=self.model.steps.set_lane(
            self.state.sampling, np.int32(lane), LaneParams.of([params]), row))

    # -- calls outside plans (process 0) -----------------------------------------------------

    @_in_scope
    def dispatch(self, inputs) -> tuple:
        """The jitted step alone over the state (donated): (Sampled, or a verify step's
        (Sampled, accepted, Latest); Tallies). Plans are the serving path; benchmarks time this one
        bare."""
        self._own()
        sampled, self.state, tallies = self._jitted(inputs)(self.model.step_params, self.state,
                                                            inputs)
        return sampled, tallies

    @_in_scope
    def precompile(self, warmups: list[tuple]) -> None:
        """Compiles the warm-up steps `warmups` ((shape, swap batch) pairs, as StepPlan.warmup
        and .swaps carry them) before they run. With a compile cache folder the steps' kept
        executables (LoadedModel.executables) are loaded first, side by side on
        LoadedModel.compile_workers threads, and the steps that had none are lowered, compiled,
        saved and kept, so running them calls the executables. The compiles run side by side
        on those threads too: tracing holds the GIL, so the steps are lowered one by one first;
        XLA compiles without it (a jitted function's calls and its lower().compile() share one
        cache). With one worker and no folder it does nothing: the runs compile as they come."""
        start = time.perf_counter()
        todo = [(str(shape), self.model.warmup_inputs(*shape, swaps)) for shape, swaps in warmups]
        kept = self.model.executables
        if kept is not None:
            workers = self.model.compile_workers(len(todo))
            keys = kept.keys(DonatingStep.shared(self.model.step_params, self.state),
                             [(self._jitted(inputs), shape, inputs) for shape, inputs in todo])
            loaded = kept.load([(self._jitted(inputs), shape, key, inputs)
                                for (shape, inputs), key in zip(todo, keys)], workers)
            keys = [key for key, done in zip(keys, loaded) if not done]
            todo = [step for step, done in zip(todo, loaded) if not done]
            log.info("warm-up: %d of %d step executables loaded from %s on %d threads in %.1f s",
                     kept.loaded, len(warmups), kept.folder, workers,
                     time.perf_counter() - start)
        workers = self.model.compile_workers(len(todo))
        if not todo or (kept is None and workers < 2):
            return
        start = time.perf_counter()
        lowered = [self.lower(inputs) for _, inputs in todo]
        lowering = time.perf_counter() - start

        def compile_one(step) -> tuple:
            begin = time.perf_counter()
            return step.compile(), time.perf_counter() - begin

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            compiled, each = zip(*pool.map(compile_one, lowered))
        log.info("warm-up: %d step shapes lowered one by one in %.1f s, then compiled on %d "
                 "threads in %.1f s (%.1f to %.1f s each)", len(lowered), lowering, workers,
                 time.perf_counter() - start, min(each), max(each))
        if kept is not None:
            for (shape, inputs), key, executable in zip(todo, keys, compiled):
                kept.save(self._jitted(inputs), shape, key, inputs, executable)

    @_in_scope
    def lower(self, inputs):
        """The jitted step lowered for `inputs` (cost analysis, HLO); the state is not consumed."""
        return self._jitted(inputs).lower(self.model.step_params, self.state, inputs)

    def _jitted(self, inputs):
        """The jitted step that takes `inputs`: the verify step's (speculative decoding) or the
        mixed step's."""
        steps = self.model.steps
        return steps.verify if isinstance(inputs, VerifyInputs) else steps.step

    @_in_scope
    def update_experts(self, fn) -> None:
        """The expert state through `fn(experts) -> experts` between steps: residency's
        between-step operations (reseed, drain, move_to, apply_swaps). Across processes each
        batch residency applies reaches the peers as it applies (Residency.on_apply)."""
        self._own()
        self.state = self.state.replace(experts=fn(self.state.experts))

    @_in_scope
    def set_routing_replay(self, picks: np.ndarray | None) -> None:
        """LoadedModel.set_routing_replay, refused across processes (the picks are process 0's)."""
        if picks is not None and self.peers is not None:
            raise ValueError("routing replay is not served across processes")
        self.model.set_routing_replay(picks)

    # -- faults ----------------------------------------------------------------------------

    def damaged(self) -> bool:
        """Whether a failed call left the state's buffers donated (deleted)."""
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(self.state))

    @_in_scope
    def rebuild(self) -> None:
        """The DecodeState after a failed step (LoadedModel.rebuilt_state); the saved copies
        stay. Across processes the peers' states would have to be rebuilt with it: refused."""
        if self.peers is not None:
            raise RuntimeError("a step failed across processes: the peers' states are not "
                               "rebuilt")
        self.state = self.model.rebuilt_state(self.state)

    # -- peers -----------------------------------------------------------------------------

    @_in_scope
    def boot(self, slot_rows: np.ndarray, host_map: np.ndarray | None = None) -> None:
        """A peer takes process 0's boot map, and its host cache's map over the disk tier,
        where its own (from its history) differ."""
        residency = self.model.residency
        held = residency.follow_host(host_map, lambda: None)  # no step has run yet
        if held or not np.array_equal(slot_rows, residency.slot_rows):
            residency.slot_rows[:] = slot_rows
            self.state = self.model.rebuilt_state(self.state)

    def _follow(self, batch) -> None:
        """A peer: its host cache brought to the map `batch` carries (over the disk tier), the
        steps in flight done first where a held row is overwritten."""
        if self.follows and batch is not None:
            self.model.residency.follow_host(batch.host_slots,
                                             lambda: jax.block_until_ready(self.state))

    def _send(self, kind: str, *args) -> None:
        """To the peers; a plan with the host cache's orders since the last (HostCache.orders)."""
        if self.peers is None:
            return
        cache = self.model.residency.cache
        if kind == "plan" and cache is not None:
            args = (dataclasses.replace(args[0], host_orders=cache.take_orders()),)
        self.peers.send((kind, *args))

    def peers_lost(self) -> str:
        """Why a peer process is gone ("" while none is, or alone)."""
        return self.peers.lost if self.peers is not None else ""

    def stop_peers(self) -> None:
        """Tells the peers to stop (Engine.close, last), those still there."""
        if self.peers is not None:
            self.model.residency.on_apply = None
            if not self.peers.lost:
                self._send("stop")
            self.peers.close()
            self.peers = None

    def _own(self) -> None:
        """The state is touched only by its owner: the scheduler thread while it runs."""
        if self.owner is not None and threading.current_thread() is not self.owner:
            raise RuntimeError("the scheduler thread owns the device: go through Scheduler.call")


def pinned_pages(model: LoadedModel, state):
    """The pool's shardings (its tree) in pinned host memory, where the host tier keeps pages
    there: in one process, on a backend with pinned_host (the GPU, jax's CPU backend). Else
    None: numpy, as across processes, where each process keeps its shards of a page
    (parallel.LocalShards: a leaf split over processes has no sharding of this process's own)."""
    kind = parallel.host_memory_kind(model.mesh)
    if kind is None or parallel.process_count(model.mesh) > 1:
        return None
    return jax.tree.map(lambda leaf: leaf.sharding.with_memory_kind(kind), state.cache.pages)


def open_tiers(model: LoadedModel, state) -> Tiers | None:
    """The prompt cache's host and disk tiers behind the device pool ([cache] host_gib, disk_gib,
    disk_dir or else residency.state_dir), each said in the log; none without prompt caching.
    Each process keeps its own: a spilled page is what `parallel.to_host` reads of it (whole in
    one process, its rows gathered from a split mesh's shards; across processes this one's
    shards), and the disk tier's folder is named by the model, the split and the number of
    processes (model_key), then this process's index."""
    config = model.config
    section = config.cache
    if not model.prefix_caching or (section.host_gib == 0 and section.disk_gib == 0):
        return None
    folder, disk = section.disk_dir or config.residency.state_dir, None
    if section.disk_gib > 0 and folder:
        # the leaves' shardings (a compile of the read) only where a process holds shards of
        # them (parallel.host_shapes; in one process every leaf is whole)
        processes = parallel.process_count(model.mesh)
        shapes = model.steps.copy_shapes(state, shardings=processes > 1)
        template = Spilled(shapes.cache.pages, shapes if model.lane_snapshots else None)
        key = model_key(model.model_dir, model.page_size, template,
                        parallel.tensor_size(model.mesh), processes)
        folder = Path(folder) / "prompt_cache" / key / f"process{jax.process_index()}"
        try:
            disk = DiskTier(folder, int(section.disk_gib * 2**30), Spilled(
                *(parallel.host_shapes(part) for part in (template.pages, template.snapshot))))
        except OSError as e:  # as residency's saves: serving goes on without it
            tiers_log.warning("prompt cache: the disk tier's folder %s cannot be used (%s): no "
                              "disk tier", folder, e)
    elif section.disk_gib > 0:
        tiers_log.info("cache.disk_gib = %g: neither cache.disk_dir nor residency.state_dir is "
                       "set, so the prompt cache has no disk tier", section.disk_gib)
    if section.host_gib == 0 and disk is None:
        return None
    tiers_log.info("prompt cache tiers: %g GiB in host memory%s", section.host_gib,
                   f", {section.disk_gib:g} GiB under {folder}" if disk is not None else "")
    return Tiers(int(section.host_gib * 2**30), disk)
