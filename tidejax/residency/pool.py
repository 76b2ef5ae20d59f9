"""The host pool of routed experts and the slot budget of the device bank."""

from __future__ import annotations

import jax
import numpy as np

from tidejax import parallel
from tidejax.contract import expert_axes, interleave_gate_up
from tidejax.errors import ConfigError


def host_pool(rows: dict, mesh=None) -> dict:
    """Places a bank-format dict of arrays [L_moe * E, ...] in host memory the devices of `mesh`
    (None: parallel.current_mesh) can read inside a jit (tidejax.parallel.host_sharding, by the
    pool's logical axes)."""
    return parallel.put(rows, expert_axes(rows, "experts"), mesh, memory="host")


def pool_rows(put_row, tensor: int):
    """The put_row(row, arrays) loading fills the host pool through: `put_row`'s, each row in
    the pool's layout first (`pool_layout`)."""
    if tensor == 1:
        return put_row
    return lambda row, arrays: put_row(row, pool_layout(arrays, tensor))


def pool_layout(arrays: dict, tensor: int) -> dict:
    """One expert row as the host pool holds it where the mesh splits "tensor" `tensor` ways:
    its gate_up interleaved by tensor block (tidejax.contract.interleave_gate_up), so each
    device's shard is a bank of the kernels' layout."""
    return arrays if tensor == 1 else interleave_gate_up(arrays, tensor)


def row_bytes(rows: dict) -> int:
    """Bytes of one expert row (all its matrices and scales)."""
    return sum(int(np.prod(a.shape[1:])) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(rows))


def n_rows(rows: dict) -> int:
    return jax.tree.leaves(rows)[0].shape[0]


def budget_slots(budget_experts: int, budget_gib: float, bytes_per_row: int, total_rows: int,
                 source: str = "[residency]",
                 names: tuple[str, str] = ("budget_experts", "budget_gib")) -> int:
    """Slots for a budget: `budget_experts`, else `budget_gib` of rows, else every row (0 and 0
    = all). Never more than there are rows. `names`: the two fields, as errors name them (the
    bank's, or the host pool's: host_slots)."""
    count, gib = names
    if budget_experts < 0 or budget_gib < 0:
        raise ConfigError(f"{source}: {count} and {gib} must not be negative")
    if budget_experts and budget_gib:
        raise ConfigError(f"{source}: give {count} or {gib}, not both")
    if budget_experts:
        slots = budget_experts
    elif budget_gib:
        slots = int(budget_gib * 2**30 // bytes_per_row)
        if slots == 0:
            raise ConfigError(f"{source}: {gib} = {budget_gib} holds no expert row "
                              f"({bytes_per_row} bytes each)")
    else:
        slots = total_rows
    return min(slots, total_rows)


def host_slots(section, bytes_per_row: int, total_rows: int) -> int:
    """Rows the host pool holds for a ResidencySection: host_budget_experts, else
    host_budget_gib of rows as served, else every row."""
    return budget_slots(section.host_budget_experts, section.host_budget_gib, bytes_per_row,
                        total_rows, names=("host_budget_experts", "host_budget_gib"))


def layer_slots(slots: int, n_layers: int, geometry: str, source: str = "[residency]") -> int:
    """Slots per layer for the per_layer geometry (0 for the arena)."""
    if geometry == "arena":
        return 0
    if geometry != "per_layer":
        raise ConfigError(f"{source}: geometry = {geometry!r}, expected per_layer or arena")
    if slots < n_layers:
        raise ConfigError(f"{source}: a budget of {slots} experts gives no slot to some of the "
                          f"{n_layers} MoE layers (geometry per_layer)")
    return slots // n_layers
