"""Grouped MoE over the expert bank: y[t] = sum_j w[t,j] * down_s(silu(g) * u), s = slot_ids[t,j].

`moe_grouped_reference` (jnp, exact in float32, runs everywhere) and the Pallas GPU kernel
(moe_kernel.py) keep one contract (tidejax.contract); tidejax.ops.moe_grouped picks between them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tidejax.contract import split_gate_up, swiglu
from tidejax.pallas.bank import bank_dims, dequantized
from tidejax.pallas.demand import Demand, check_demand, count_demand_reference

HIGHEST = jax.lax.Precision.HIGHEST


def _check_args(x, bank, slot_ids, weights, demand):
    n, d, _ = bank_dims(bank)
    t = x.shape[0]
    if x.ndim != 2 or x.shape[1] != d:
        raise ValueError(f"moe_grouped: x has shape {x.shape}, expected [T, {d}]")
    if slot_ids.ndim != 2 or slot_ids.shape[0] != t or weights.shape != slot_ids.shape:
        raise ValueError(
            f"moe_grouped: slot_ids {slot_ids.shape} and weights {weights.shape} must both be [{t}, k]"
        )
    if demand is not None:
        check_demand(demand, *slot_ids.shape)
    return n


# Up to this many picks the reference gathers each pick's weights, above it scans the slots. The
# choice depends on the picks alone, never on the bank's size, so the same tokens give the same
# bits whichever experts are resident.
GATHER_PICKS = 64


def moe_grouped_reference(x, bank, slot_ids, weights, *, swiglu_limit: float = 0.0,
                          swiglu_alpha: float = 1.0, swiglu_up_shift: float = 0.0,
                          demand: Demand | None = None):
    """x [T, D], slot_ids [T, k] int32 (-1 = skip), weights [T, k] -> y [T, D] of x.dtype; with
    `demand`, (y, counts, weight_sums) after `count_demand_reference` of its picks.

    The activation and the optional bias leaves: tidejax.contract. Float32 throughout (HIGHEST
    precision dots). Up to GATHER_PICKS picks it gathers their weights;
    otherwise it scans over the slots, so memory stays at one slot's weights (dequantized) plus
    [T, 2I] activations and the [T, k, D] per-pick outputs.
    """
    n = _check_args(x, bank, slot_ids, weights, demand)
    xf = x.astype(jnp.float32)
    picked = slot_ids >= 0
    w = jnp.where(picked, weights.astype(jnp.float32), 0.0)  # [T, k]

    def act(h, row):  # gate_up projection [..., 2I] -> activation [..., I]
        if "gate_up_bias" in row:
            h = h + row["gate_up_bias"]
        return swiglu(*split_gate_up(h), swiglu_limit, swiglu_alpha, swiglu_up_shift)

    def biased(out, row):
        return out + row["down_bias"] if "down_bias" in row else out

    if slot_ids.size <= GATHER_PICKS:
        rows = jax.tree.map(lambda a: a[jnp.maximum(slot_ids, 0)], bank)  # [T, k, ...]
        rows = dequantized(rows)
        h = jnp.einsum("td,tkfd->tkf", xf, rows["gate_up"], precision=HIGHEST)
        per_pick = biased(jnp.einsum("tki,tkdi->tkd", act(h, rows), rows["down"],
                                     precision=HIGHEST), rows)
    else:
        def one_slot(acc, slot_and_row):
            slot, row = slot_and_row
            row = dequantized(row)
            hits = slot_ids == slot  # [T, k]
            h = jnp.dot(xf, row["gate_up"].T, precision=HIGHEST)  # [T, 2I]
            out = biased(jnp.dot(act(h, row), row["down"].T, precision=HIGHEST), row)  # [T, D]
            return jnp.where(hits[:, :, None], out[:, None, :], acc), None

        # Each pick's output lands in its own [T, k] cell and the weighted sum runs in pick order,
        # so the result does not depend on which slot holds an expert (swaps are lossless, bit for
        # bit).
        per_pick = jnp.zeros((*slot_ids.shape, xf.shape[1]), jnp.float32)  # [T, k, D]
        per_pick, _ = jax.lax.scan(one_slot, per_pick, (jnp.arange(n, dtype=slot_ids.dtype), bank))
    y = jnp.einsum("tk,tkd->td", w, per_pick, precision=HIGHEST).astype(x.dtype)
    return y if demand is None else (y, *count_demand_reference(*demand))

