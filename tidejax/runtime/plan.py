"""What the scheduler decides for one iteration, as plain data the runner carries out.

A `StepPlan` holds only numpy arrays and Python values (no jax.Array, no callable), so the same
plan drives the runner of process 0 and, sent over the channel, each peer's (runtime/runner.py).
A peer first obeys the plan's `host_orders` (process 0's host cache reads and drops over the
disk tier) and brings its host cache to each batch's map before the batch applies. The runner
does its parts in this order:

    reads     sequences saved to host memory (preemption): each `SequenceCopy`'s pages of the
              pool, its lane's rows and token counts, kept by the runner under `copy`
    spills    pages the pool evicted, read by `reads`, put in the prompt cache's host tier
              page by page under their block hashes (`PageSpill`), each runner its own
    forget    copies dropped (a preempted request cancelled; a spill's read and snapshots)
    lanes     {lane: SamplingParams}: each lane's sampling row set and its token counts cleared
              (admission; greedy again when a lane frees), but for `seen` {lane: token ids}:
              the prompt tokens of a cached prefix, marked seen (no step of the lane runs them)
    restores  prompt-cache pages back from host memory or disk written into the pool, as many
              as every process holds (`PageRestore`; the StepResult says how many)
    writes    copies put back at new pages and a lane (resumption), then dropped; a write
              that `keep`s its copy (a prompt-cache snapshot of a lane, written at each match)
              leaves it until a `forget`
    experts   swap batches residency applies between steps (drain, reseed: process 0 applies
              its own through Runner.update_experts; its peers take them from here)
    then at most one device call: the mixed step (`decode` and / or `prefill`, with the step's
    swap batch), a scoring forward (`score`) or a warm-up step (`warmup`).

Reads come before the lanes are reset and writes after the lanes are set, so one plan may
preempt a request and admit another into its lane.
"""

from __future__ import annotations

import dataclasses

from tidejax.residency.swap import SwapBatch
from tidejax.runtime.sampling import SamplingParams
from tidejax.runtime.steps import DecodeRows, PrefillChunk


@dataclasses.dataclass(frozen=True)
class SequenceCopy:
    """A sequence's place for a read or a write: its pages of the pool and its lane; `copy`
    numbers the copy in host memory that the runners keep (process 0 numbers them). No pages:
    the lane's rows and token counts alone (a snapshot). `keep`: a write that keeps the copy."""

    copy: int
    pages: tuple[int, ...]
    lane: int
    keep: bool = False


@dataclasses.dataclass(frozen=True)
class PageSpill:
    """The pages a read (`copy`, of this plan's reads) holds, in its order: the block hash of
    each and the number of the lane snapshot kept with it (a copy the runners hold; None:
    none), which goes with it. `closing`: pages the device pool still indexes, on their way to
    disk at close (Scheduler.close_tiers): the runner waits for its disk writes after them."""

    copy: int
    digests: tuple[bytes, ...]
    snapshots: tuple[int | None, ...]
    closing: bool = False


@dataclasses.dataclass(frozen=True)
class PageRestore:
    """Prompt-cache entries (`digests`: block hashes) for `pages` of the pool: the longest run
    from the first that every process holds (Runner._restore: an entry missing or corrupt on
    one process shortens it for all); `snapshots`: a number for each entry, under which the
    runners keep its lane snapshot where every process has one (None: no lane snapshots, the
    run not cut back to an entry with one). The warm-up's restore names a kept `copy` instead,
    whose pages go back as they are."""

    pages: tuple[int, ...]
    digests: tuple[bytes, ...] = ()
    snapshots: tuple[int, ...] | None = None
    copy: int | None = None


@dataclasses.dataclass
class StepPlan:
    reads: list[SequenceCopy] = dataclasses.field(default_factory=list)
    spills: list[PageSpill] = dataclasses.field(default_factory=list)
    forget: list[int] = dataclasses.field(default_factory=list)
    lanes: dict[int, SamplingParams] = dataclasses.field(default_factory=dict)
    seen: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    restores: list[PageRestore] = dataclasses.field(default_factory=list)
    writes: list[SequenceCopy] = dataclasses.field(default_factory=list)
    experts: list[SwapBatch] = dataclasses.field(default_factory=list)
    decode: DecodeRows | None = None  # the decoding lanes
    prefill: PrefillChunk | None = None  # the prompt chunk
    # the step whose sampled tokens (a verify step's: latest tokens and their positions) the
    # decoding lanes not `fresh` take as input (its number, StepResult.step); None: every
    # input comes from the host
    previous: int | None = None
    swaps: SwapBatch | None = None  # residency's batch for the step's start (or the score's)
    logprobs: bool = False  # whether to start the step's logprobs toward the host too
    score: list[int] | None = None  # token ids of a scoring forward (a scratch cache)
    # a warm-up step: (chunk bucket or 0, prefill table width, decode table width), every
    # token masked out (LoadedModel.warmup_inputs)
    warmup: tuple | None = None
    # over the disk tier across processes: process 0's host cache orders since its last plan
    # ([("read" | "drop", rows)], HostCache.orders), which each peer's cache obeys first
    host_orders: list = dataclasses.field(default_factory=list)

    @property
    def verify(self) -> bool:
        """Whether the step is a verify step (speculative decoding: DecodeRows.drafted set; it
        may carry a prompt chunk too)."""
        return self.decode is not None and self.decode.drafted is not None

    @property
    def steps(self) -> bool:
        """Whether the plan runs the mixed step."""
        return self.decode is not None or self.prefill is not None

    @property
    def empty(self) -> bool:
        """Whether there is nothing to do."""
        return not (self.reads or self.spills or self.forget or self.lanes or self.restores
                    or self.writes or self.experts
                    or self.steps or self.score is not None or self.warmup is not None)

    @property
    def routed(self) -> int:
        """Real tokens the step sends through each MoE layer (residency's after_step)."""
        chunk = len(self.prefill.tokens) if self.prefill is not None else 0
        if self.verify:  # each active lane's token and its drafts
            return chunk + int((self.decode.active * (1 + self.decode.drafted)).sum())
        return chunk + (int(self.decode.active.sum()) if self.decode is not None else 0)
