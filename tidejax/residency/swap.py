"""Swap batches: what residency hands to the next step, and how a step applies it.

`Residency.next_batch()` returns a `SwapBatch` of a fixed length (swaps already checked against
the host mirror of the map, whether to drain the counters, whether the ring copies); the next
jitted step calls `apply_batch` on the expert state at its start, so expert rows move from the
host pool into bank slots in place inside the step that needs them, not in calls of their own,
and the ring's copies start (residency/ring.py); and `finish_batch` at its end, which chooses the
ring's next rows, returns the step's `Tallies` (its miss tally and the counters) and, on a
drain, restarts the counters from zero.
Between steps (boot, calibration, tools) `apply_now` runs the same function alone.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tidejax.residency import ring
from tidejax.residency.state import ExpertState, Picks, read_row, write_row


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SwapBatch:
    """slots, rows [B] int32: the first `count` (int32 scalar) pairs are written in order (pool row
    rows[i] into bank slot slots[i]) at the step's start; drain (bool scalar): at its end the
    counters leave in the step's Tallies and restart from zero; exact_weight (float32 scalar):
    miss policy "auto"'s threshold for the step. B is 0 for a batch without swaps (the step then
    has no swap loop) and the engine's batch_length otherwise, so a step compiles at most twice
    whatever the count."""

    slots: jax.Array
    rows: jax.Array
    count: jax.Array
    drain: jax.Array
    exact_weight: jax.Array
    ring: jax.Array
    host_slots: jax.Array | None = None  # [L_moe * E] int32: the host cache's map for the step
    # (ExpertState.host_slots); None where the pool holds every row

    @staticmethod
    def of(pairs: list[tuple[int, int]], length: int, drain: bool = False,
           exact_weight: float = 0.0, ring: bool = False, host_slots=None) -> "SwapBatch":
        if len(pairs) > length:
            raise ValueError(f"{len(pairs)} swaps do not fit a batch of {length}")
        slots, rows = np.zeros(length, np.int32), np.zeros(length, np.int32)
        for i, (slot, row) in enumerate(pairs):
            slots[i], rows[i] = slot, row
        return SwapBatch(slots, rows, np.int32(len(pairs)), np.bool_(drain),
                         np.float32(exact_weight), np.bool_(ring), host_slots)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tallies:
    """What a step hands back to residency: misses [L_moe, E] (the step's wanted picks served by a
    miss); approx [L_moe, E] (the routing weight shares of those served approximately); counts,
    weight_sums [L_moe, E] (the counters through the step, read where its batch drained);
    ring_hits (float32 scalar: wanted picks served from ring slots), ring_copies (int32 scalar:
    rows written into ring slots); picks: the step's Picks where routing traces are on, else
    None."""

    misses: jax.Array
    approx: jax.Array
    counts: jax.Array
    weight_sums: jax.Array
    ring_hits: jax.Array
    ring_copies: jax.Array
    picks: Picks | None = None


def _swap(state: ExpertState, maps, slot, row):
    """maps = (bank, rowmap, slot_rows) with pool row `row` (= moe_layer * E + expert) written
    into `slot`: the slot's previous expert and any other slot holding `row` become
    non-resident; row -1 empties the slot. (Residency hands out a swap only once its row is in
    host memory.)"""
    bank, rowmap, slot_rows = maps
    old = slot_rows[slot]
    flat = rowmap.reshape(-1)
    nowhere = flat.size  # an out-of-range index: the update is dropped
    flat = flat.at[jnp.where(old >= 0, old, nowhere)].set(-1, mode="drop")
    flat = flat.at[jnp.where(row >= 0, row, nowhere)].set(slot, mode="drop")
    slot_rows = jnp.where((slot_rows == row) & (row >= 0), -1, slot_rows).at[slot].set(row)
    bank = write_row(bank, slot, read_row(state, row))
    return bank, flat.reshape(rowmap.shape), slot_rows


def swap_rows(state: ExpertState, slots, rows, count) -> ExpertState:
    """Applies the first `count` swaps (slots[i], rows[i]), in order: bank, rowmap and its inverse
    are updated in place where the state is donated into the jit that traces this."""
    maps = jax.lax.fori_loop(0, count, lambda i, m: _swap(state, m, slots[i], rows[i]),
                             (state.bank, state.rowmap, state.slot_rows))
    return state.replace(bank=maps[0], rowmap=maps[1], slot_rows=maps[2])


def apply_batch(state: ExpertState, batch: SwapBatch) -> ExpertState:
    """A step's start (traced inside it): the batch's swaps and threshold, then the ring's
    copies (ring.start: the rows fetched by the step before written, the next ones fetched)."""
    if batch.host_slots is not None:
        state = state.replace(host_slots=batch.host_slots)
    if batch.slots.shape[0]:  # static: an all-resident engine's batches are empty
        state = swap_rows(state, batch.slots, batch.rows, batch.count)
    return ring.start(state.replace(exact_weight=batch.exact_weight), batch.ring)


def finish_batch(state: ExpertState, batch: SwapBatch) -> tuple[ExpertState, Tallies]:
    """A step's end (traced inside it): the ring's next rows chosen (ring.choose); its Tallies
    (the miss tallies and the counters including this step); the tallies restart from zero for
    the next step, and the counters too where the batch drains."""
    state = ring.choose(state, batch.ring)
    zeros = jnp.zeros_like(state.counts)
    out = Tallies(state.misses, state.approx, state.counts, state.weight_sums, state.ring_hits,
                  state.ring_copied, state.picks)
    picks = state.picks
    if picks is not None:  # the next step's picks start at row 0 of an empty buffer
        picks = picks.replace(ids=jnp.full_like(picks.ids, -1), at=jnp.zeros_like(picks.at))
    return state.replace(picks=picks,
                         counts=jnp.where(batch.drain, zeros, state.counts),
                         weight_sums=jnp.where(batch.drain, zeros, state.weight_sums),
                         misses=zeros, approx=zeros,
                         exact_used=jnp.zeros_like(state.exact_used),
                         ring_hits=jnp.zeros_like(state.ring_hits),
                         ring_copied=jnp.zeros_like(state.ring_copied)), out


@functools.partial(jax.jit, donate_argnums=0)
def apply_now(state: ExpertState, batch: SwapBatch) -> tuple[ExpertState, Tallies]:
    """A batch alone, between steps (the state donated: in place): what a step does with it,
    less the forward."""
    return finish_batch(apply_batch(state, batch), batch)
