"""Swaps between steps: expert rows from the host pool into bank slots, in place."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tidejax.residency.state import ExpertState, fetch_row, write_row


def _swap(pool, maps, slot, row):
    """maps = (bank, rowmap, slot_rows) with pool row `row` (= moe_layer * E + expert) written
    into `slot`: the slot's previous expert and any other slot holding `row` become
    non-resident; row -1 empties the slot."""
    bank, rowmap, slot_rows = maps
    old = slot_rows[slot]
    flat = rowmap.reshape(-1)
    nowhere = flat.size  # an out-of-range index: the update is dropped
    flat = flat.at[jnp.where(old >= 0, old, nowhere)].set(-1, mode="drop")
    flat = flat.at[jnp.where(row >= 0, row, nowhere)].set(slot, mode="drop")
    slot_rows = jnp.where((slot_rows == row) & (row >= 0), -1, slot_rows).at[slot].set(row)
    bank = write_row(bank, slot, fetch_row(pool, row))
    return bank, flat.reshape(rowmap.shape), slot_rows


@functools.partial(jax.jit, donate_argnums=0)
def swap_rows(state: ExpertState, slots, rows, count) -> ExpertState:
    """Applies the first `count` swaps (slots[i], rows[i]), in order, in one call. slots / rows
    have a fixed length, so any count up to it reuses one compilation. The state is donated:
    bank, rowmap and its inverse are updated in place."""
    maps = jax.lax.fori_loop(0, count, lambda i, m: _swap(state.pool, m, slots[i], rows[i]),
                             (state.bank, state.rowmap, state.slot_rows))
    return state.replace(bank=maps[0], rowmap=maps[1], slot_rows=maps[2])


@functools.partial(jax.jit, donate_argnums=0)
def taken(counters):
    """(counters, zeros like them) for `counters` (a pytree of device arrays, donated): the host
    reads the first while steps count into the second. Jitted, so the zeros keep the placement
    the step was compiled for: fresh host-made arrays would be uncommitted and make the next step
    compile again."""
    return counters, jax.tree.map(jnp.zeros_like, counters)
