"""The planner: which cold experts to swap in, and which resident ones they replace.

A cold expert comes in when its decayed demand is >= `hysteresis` x the demand of the least busy
resident expert it would replace (an empty slot is always replaced); each layer takes part in at
most `max_per_layer` swaps of a plan (as the incoming or the outgoing side). Pure numpy on the
host; the manager applies the plan a few swaps per step.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Swap:
    slot: int
    row: int  # pool row coming in: moe_layer * E + expert
    version: int = 0  # the map version the swap was planned on


def slot_groups(n_resident: int, n_layers: int, geometry: str) -> list[np.ndarray]:
    """Slots that compete with each other: one group per layer (per_layer) or one arena."""
    if geometry == "arena":
        return [np.arange(n_resident)]
    per = n_resident // n_layers
    return [np.arange(layer * per, (layer + 1) * per) for layer in range(n_layers)]


def group_rows(n_layers: int, n_experts: int, geometry: str) -> list[np.ndarray]:
    """Pool rows each group may hold (a layer's experts, or every row for the arena)."""
    if geometry == "arena":
        return [np.arange(n_layers * n_experts)]
    return [np.arange(layer * n_experts, (layer + 1) * n_experts) for layer in range(n_layers)]


def plan(demand: np.ndarray, slot_rows: np.ndarray, geometry: str, hysteresis: float = 1.5,
         max_per_layer: int = 2) -> list[Swap]:
    """demand [L_moe, E]; slot_rows [resident] the pool row of each resident slot (-1 empty)."""
    n_layers, n_experts = demand.shape
    flat = demand.reshape(-1)
    touched = np.zeros(n_layers, int)
    held = np.zeros(flat.size, bool)
    held[slot_rows[slot_rows >= 0]] = True
    swaps = []
    for slots, rows in zip(slot_groups(len(slot_rows), n_layers, geometry),
                           group_rows(n_layers, n_experts, geometry)):
        resident_rows = slot_rows[slots]
        resident_demand = np.where(resident_rows >= 0, flat[np.maximum(resident_rows, 0)], -1.0)
        out_order = slots[np.argsort(resident_demand, kind="stable")]  # least busy first
        cold = rows[~held[rows]]
        in_order = cold[np.argsort(-flat[cold], kind="stable")]  # busiest first
        taken = 0
        for row in in_order:
            if flat[row] <= 0:
                break
            if touched[row // n_experts] >= max_per_layer:
                continue
            while taken < len(out_order) and _capped(slot_rows[out_order[taken]], touched,
                                                     n_experts, max_per_layer):
                taken += 1
            if taken == len(out_order):
                break
            slot = out_order[taken]
            old = slot_rows[slot]
            if old >= 0 and flat[row] < hysteresis * flat[old]:
                break
            swaps.append(Swap(slot=int(slot), row=int(row)))
            touched[row // n_experts] += 1
            if old >= 0 and old // n_experts != row // n_experts:
                touched[old // n_experts] += 1
            taken += 1
    return swaps


def _capped(row: int, touched: np.ndarray, n_experts: int, cap: int) -> bool:
    return row >= 0 and touched[row // n_experts] >= cap


def fit_rows(demand: np.ndarray, n_resident: int, geometry: str) -> np.ndarray:
    """The rows a budget of `n_resident` slots keeps for this demand, busiest first within each
    group: per layer the busiest n_resident // L_moe experts (layer by layer), or the busiest rows
    of the whole arena. Ties keep the lower row."""
    n_layers, n_experts = demand.shape
    flat = demand.reshape(-1)
    out = [rows[np.argsort(-flat[rows], kind="stable")][:len(slots)]
           for slots, rows in zip(slot_groups(n_resident, n_layers, geometry),
                                  group_rows(n_layers, n_experts, geometry))]
    return np.concatenate(out).astype(np.int32)


def place(rows: np.ndarray, n_resident: int, n_layers: int, n_experts: int,
          geometry: str) -> np.ndarray:
    """slot_rows [n_resident] holding `rows` (busiest first; those beyond a group's slots are
    dropped), the slots left over filled with the lowest rows not yet held."""
    rows = np.asarray(rows, np.int64)
    if rows.size and (rows.min() < 0 or rows.max() >= n_layers * n_experts):
        raise ValueError(f"rows must be in [0, {n_layers * n_experts})")
    slot_rows = np.full(n_resident, -1, np.int32)
    for slots, allowed in zip(slot_groups(n_resident, n_layers, geometry),
                              group_rows(n_layers, n_experts, geometry)):
        mine = rows[np.isin(rows, allowed)]
        mine = mine[np.sort(np.unique(mine, return_index=True)[1])][:len(slots)]
        rest = allowed[~np.isin(allowed, mine)][:len(slots) - len(mine)]
        slot_rows[slots] = np.concatenate([mine, rest])
    return slot_rows
