"""Swaps between steps: one expert row from the host pool into one bank slot, in place."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tidejax.residency.state import ExpertState, fetch_row, write_row


@functools.partial(jax.jit, donate_argnums=0)
def swap_row(state: ExpertState, slot, row) -> ExpertState:
    """Writes pool row `row` (= moe_layer * E + expert) into bank slot `slot` and updates the
    rowmap and its inverse: the slot's previous expert and any other slot holding `row` become
    non-resident; row -1 empties the slot. The state is donated: updated in place."""
    old = state.slot_rows[slot]
    flat = state.rowmap.reshape(-1)
    nowhere = flat.size  # an out-of-range index: the update is dropped
    flat = flat.at[jnp.where(old >= 0, old, nowhere)].set(-1, mode="drop")
    flat = flat.at[jnp.where(row >= 0, row, nowhere)].set(slot, mode="drop")
    slot_rows = jnp.where((state.slot_rows == row) & (row >= 0), -1, state.slot_rows)
    slot_rows = slot_rows.at[slot].set(row)
    bank = write_row(state.bank, slot, fetch_row(state.pool, row))
    return state.replace(bank=bank, rowmap=flat.reshape(state.rowmap.shape), slot_rows=slot_rows)


def drained(state: ExpertState) -> ExpertState:
    """The state with fresh zeroed counters (after the host has read them)."""
    shape = state.counts.shape
    return state.replace(counts=jnp.zeros(shape, jnp.float32), weight_sums=jnp.zeros(shape, jnp.float32),
                         misses=jnp.zeros(shape, jnp.float32))
