"""The `ring` policy's copies, overlapped with the steps' compute.

A step's misses are substituted (serve.py). At its end the step picks the rows that carried the
most routing weight among its misses (the `approx` tally: their routing weight shares summed per
expert), not in the bank and not already on their way, and leaves them in
`ExpertState.ring_rows` (`choose`). The next step, at its start (`start`), first writes the
rows the step before it fetched (`ring_staged`) into ring slots, oldest slot first, a
device-to-device copy before any layer reads the bank (as a swap is); then it fetches
`ring_rows` from the host pool into a new `ring_staged`. That fetch reads only the pool and
`ring_rows`, and only the step's output state reads what it fetched, so no layer waits on it and
it waits on no layer: on the GPU, XLA's host-memory-transfer asyncifier makes each host-memory
dynamic slice an asynchronous copy that runs beside the step's layers. So a copy issued in one
step is routable in the next; a miss in step N is routable from step N + 2, and no step stalls
for a copy.

Every step of a ring engine fetches its R rows (R = `ring_copies`): a fixed shape compiles once
and needs no loop, whose dynamic trip count would make the GPU's host wait; a pad (row -1) fetches
pool row 0, which is never written. While residency is frozen (`on` False) the ring stands still:
the staged rows are fetched again, nothing is written or chosen. The ring's slots are the
device's own: the host's map holds the resident slots; a row the planner swaps in leaves its
ring slot (swap._swap), and a row already in the bank is never written into one.

Over the disk tier (residency.host_budget_experts) the ring copies only rows in host memory (the
step's `host_slots` map): `choose` passes over a miss of a row on disk, and `start` drops a chosen
row that a commit has taken out of host memory since. Those misses are read from disk by the
host instead (Residency._read_tallies: the heaviest first, off the step's path), so a later step
can choose them; once read they stay in host memory until a step has fetched them
(Residency._ring_pending); the step itself never waits for the disk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tidejax.residency.state import ExpertState, read_row


def start(state: ExpertState, on) -> ExpertState:
    """A step's start, after its swaps: the staged rows written into ring slots, the next ones
    fetched (`on`: bool scalar, residency not frozen)."""
    if not state.ring_rows.shape[0]:  # static: no ring
        return state
    with jax.named_scope("ring_write"):
        state = _write_staged(state, on)
    rows = jnp.where(on, state.ring_rows, state.ring_staged_rows)  # [R]
    if state.host_slots is not None:  # over the disk tier: rows in host memory only
        rows = jnp.where(state.host_slots[jnp.maximum(rows, 0)] >= 0, rows, -1)
    with jax.named_scope("ring_fetch"):  # the name a profile finds the copies by
        fetched = [read_row(state, jnp.maximum(rows[i], 0)) for i in range(rows.shape[0])]
        staged = jax.tree.map(lambda *r: jnp.stack(r), *fetched)
    return state.replace(ring_staged=staged, ring_staged_rows=rows)


def choose(state: ExpertState, on) -> ExpertState:
    """A step's end: the rows the next step fetches, this step's misses that are neither in the
    bank nor staged, heaviest routing weight first (-1 pads); unchanged unless `on`."""
    rows = state.ring_rows
    if not rows.shape[0]:
        return state
    flat = state.rowmap.reshape(-1)  # [L_moe * E]
    pending = state.ring_staged_rows
    staged = jnp.zeros(flat.shape, bool).at[jnp.where(pending >= 0, pending, flat.size)].set(
        True, mode="drop")
    weight = jnp.where((flat >= 0) | staged, 0.0, state.approx.reshape(-1))
    if state.host_slots is not None:  # a row on disk is read by the host, not copied
        weight = jnp.where(state.host_slots >= 0, weight, 0.0)
    top, heavy = jax.lax.top_k(weight, rows.shape[0])
    return state.replace(ring_rows=jnp.where(on, jnp.where(top > 0, heavy, -1), rows)
                         .astype(jnp.int32))


def _write_staged(state: ExpertState, on) -> ExpertState:
    """`ring_staged` into ring slots, oldest first: each row that is still not in the bank (a
    swap may have brought it in), the rows the slots held leaving the map."""
    flat = state.rowmap.reshape(-1)  # [L_moe * E]
    nowhere = flat.size  # an out-of-range index: the update is dropped
    rows = state.ring_staged_rows  # [R]
    valid = on & (rows >= 0) & (flat[jnp.maximum(rows, 0)] < 0)
    place = (state.ring_next + jnp.cumsum(valid) - 1) % state.ring
    slots = jnp.where(valid, state.resident + place, state.n_slots)  # [R]; n_slots: dropped
    old = state.slot_rows.at[slots].get(mode="fill", fill_value=-1)  # the rows they held
    flat = flat.at[jnp.where(valid & (old >= 0), old, nowhere)].set(-1, mode="drop")
    flat = flat.at[jnp.where(valid, rows, nowhere)].set(slots, mode="drop")
    copied = valid.sum(dtype=jnp.int32)
    bank = jax.tree.map(lambda b, r: b.at[slots].set(r.astype(b.dtype), mode="drop"),
                        state.bank, state.ring_staged)
    return state.replace(bank=bank, rowmap=flat.reshape(state.rowmap.shape),
                         slot_rows=state.slot_rows.at[slots].set(rows, mode="drop"),
                         ring_copied=copied, ring_next=(state.ring_next + copied) % state.ring)
