"""Demand counting: counts[layer, e] += 1 and weight_sums[layer, e] += w for every wanted pick.

The counting runs fused into `moe_grouped` (its `demand=` argument); on the GPU kernel the
programs of the gate/up pass add their share of picks with atomic adds. This module holds the
counters' container and the jnp reference."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp


class Demand(NamedTuple):
    """One MoE layer's wanted picks and the counters they go to (a pytree)."""

    counts: Any  # [L_moe, E] float32
    weight_sums: Any  # [L_moe, E] float32
    layer: Any  # int or int32 scalar: the MoE layer's row of the counters
    ids: Any  # [T, k] int32: the experts the router wanted (not their slots); -1 = none
    weights: Any  # [T, k]: their routing weights
    token_mask: Any  # [T] bool: False = padding, counts nothing


def check_demand(demand: Demand, t: int, k: int) -> None:
    """Clear errors for counters that are not float32 [L_moe, E] or picks that do not fit a step
    of t tokens x top-k."""
    counts, sums = jnp.shape(demand.counts), jnp.shape(demand.weight_sums)
    if len(counts) != 2 or sums != counts:
        raise ValueError(f"demand: counts {counts} and weight_sums {sums} must both be [L_moe, E]")
    dtypes = jnp.result_type(demand.counts), jnp.result_type(demand.weight_sums)
    if dtypes != (jnp.float32, jnp.float32):
        raise ValueError(f"demand: counts and weight_sums are {dtypes}, expected float32")
    ids, weights, mask = jnp.shape(demand.ids), jnp.shape(demand.weights), jnp.shape(demand.token_mask)
    if ids != (t, k) or weights != (t, k) or mask != (t,):
        raise ValueError(f"demand: ids {ids}, weights {weights} and token_mask {mask} must be "
                         f"[{t}, {k}], [{t}, {k}] and [{t}]")


def count_demand_reference(counts, weight_sums, layer, ids, weights, token_mask):
    """counts/weight_sums [L_moe, E] f32; ids/weights [T, k]; token_mask [T] bool (False = pad)."""
    counts, weight_sums, ids = jnp.asarray(counts), jnp.asarray(weight_sums), jnp.asarray(ids)
    valid = jnp.asarray(token_mask)[:, None] & (ids >= 0)  # [T, k]
    idx = jnp.where(valid, ids, 0)
    counts = counts.at[layer, idx].add(valid.astype(counts.dtype))
    weight_sums = weight_sums.at[layer, idx].add(jnp.where(valid, weights, 0).astype(weight_sums.dtype))
    return counts, weight_sums
