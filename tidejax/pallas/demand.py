"""Demand counting: counts[layer, e] += 1 and weight_sums[layer, e] += w for every wanted pick."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tidejax.pallas.dispatch import choose_impl


def count_demand_reference(counts, weight_sums, layer, ids, weights, token_mask):
    """counts/weight_sums [L_moe, E] f32; ids/weights [T, k]; token_mask [T] bool (False = pad)."""
    counts, weight_sums, ids = jnp.asarray(counts), jnp.asarray(weight_sums), jnp.asarray(ids)
    valid = jnp.asarray(token_mask)[:, None] & (ids >= 0)  # [T, k]
    idx = jnp.where(valid, ids, 0)
    counts = counts.at[layer, idx].add(valid.astype(counts.dtype))
    weight_sums = weight_sums.at[layer, idx].add(jnp.where(valid, weights, 0).astype(weight_sums.dtype))
    return counts, weight_sums


def count_demand(counts, weight_sums, layer, ids, weights, token_mask, impl: str = "auto"):
    """Add one layer's wanted picks to the demand counters; returns (counts, weight_sums)."""
    impl = choose_impl("count_demand", impl)
    with jax.named_scope(f"count_demand_{impl}"):
        if impl == "reference":
            return count_demand_reference(counts, weight_sums, layer, ids, weights, token_mask)
        from tidejax.pallas.demand_kernel import count_demand_pallas

        return count_demand_pallas(counts, weight_sums, layer, ids, weights, token_mask)
