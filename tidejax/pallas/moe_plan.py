"""Picks of a grouped-MoE step sorted by slot into tiles of rows, each tile one expert: the plan
both grouped kernels run over (moe_kernel's dots path, moe_prefill's Triton GEMM). jnp only."""

from __future__ import annotations

import jax.numpy as jnp


def picks_per_expert(n_picks: int, n_slots: int) -> float:
    """Mean picks of each expert used in a step, under uniform routing over n_slots."""
    used = n_slots * (1 - (1 - 1 / n_slots) ** n_picks) if n_slots > 1 else 1.0
    return n_picks / max(1.0, min(used, n_picks))


def reach(n_slots: int, n_experts: int | None) -> int:
    """The most distinct slots a layer's picks can name: the bank's n_slots, or fewer where the
    bank holds several layers' slots and a layer has n_experts."""
    return n_slots if n_experts is None else min(n_slots, n_experts)


def plan_tiles(slot_ids, n_slots: int, bt: int, named: int | None = None):
    """Group picks by slot into tiles of bt rows; `named`: the most distinct slots the picks
    name (`reach`; None: n_slots), which bounds the tiles.

    Returns tile_slot [n_tiles] (slot or -1 = unused tile), row_token [n_tiles*bt] (token of each
    row; padding rows point at token 0) and pick_row [T*k] (row of each pick; skipped picks
    point past the end).
    """
    t, k = slot_ids.shape
    n_picks = t * k
    n_tiles = (n_picks + min(named or n_slots, n_picks) * (bt - 1)) // bt  # upper bound, static
    key = jnp.where(slot_ids.reshape(-1) >= 0, slot_ids.reshape(-1), n_slots)  # [P]
    order = jnp.argsort(key, stable=True)  # picks sorted by slot, skipped ones last
    counts = jnp.bincount(key, length=n_slots + 1)[:n_slots]  # picks per slot
    tiles = (counts + bt - 1) // bt
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    pick_start = jnp.cumsum(counts) - counts
    sorted_key = key[order]
    s = jnp.minimum(sorted_key, n_slots - 1)
    rank = jnp.arange(n_picks) - pick_start[s]
    row = jnp.where(sorted_key < n_slots, tile_start[s] * bt + rank, n_tiles * bt)
    pick_row = jnp.zeros(n_picks, jnp.int32).at[order].set(row.astype(jnp.int32))
    row_token = jnp.zeros(n_tiles * bt, jnp.int32).at[row].set(order // k, mode="drop")
    tile_slot = jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right").astype(jnp.int32)
    tile_slot = jnp.where(tile_slot < n_slots, tile_slot, -1)
    return tile_slot, row_token, pick_row
