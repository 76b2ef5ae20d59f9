"""Pallas (Triton lowering) demand counter: one program per token adds its k picks atomically.

The k expert ids of one token are distinct (top-k), so a program's vector atomic add has no
conflicts within itself; the lanes padding k to a power of two, and picks that do not count
(padding tokens, id -1), go to private dummy cells past the end of the flattened counters.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _count_kernel(cell_ref, one_ref, w_ref, _counts_in, _sums_in, counts_ref, sums_ref):
    t = pl.program_id(0)
    cells = cell_ref[t, :]
    plgpu.atomic_add(counts_ref, cells, one_ref[t, :])
    plgpu.atomic_add(sums_ref, cells, w_ref[t, :])


@functools.partial(jax.jit, static_argnames=("interpret",))
def count_demand_pallas(counts, weight_sums, layer, ids, weights, token_mask, *, interpret=False):
    """Same contract as `count_demand_reference`."""
    n_layers, n_experts = counts.shape
    t, k = ids.shape
    kp = pl.next_power_of_2(k)
    size = n_layers * n_experts
    valid = token_mask[:, None] & (ids >= 0)  # [T, k]
    cells = jnp.where(valid, layer * n_experts + ids, size + jnp.arange(k))
    cells = jnp.pad(cells, ((0, 0), (0, kp - k)), constant_values=0)
    cells = jnp.where(jnp.arange(kp) < k, cells, size + jnp.arange(kp)).astype(jnp.int32)
    ones = jnp.pad(valid.astype(jnp.float32), ((0, 0), (0, kp - k)))
    w = jnp.pad(jnp.where(valid, weights, 0).astype(jnp.float32), ((0, 0), (0, kp - k)))
    flat = lambda a: jnp.concatenate([a.reshape(size).astype(jnp.float32), jnp.zeros(kp, jnp.float32)])
    out_shape = jax.ShapeDtypeStruct((size + kp,), jnp.float32)
    new_counts, new_sums = pl.pallas_call(
        _count_kernel,
        out_shape=(out_shape, out_shape),
        grid=(t,),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plgpu.CompilerParams(num_warps=1),
        interpret=interpret,
        name="count_demand",
    )(cells, ones, w, flat(counts), flat(weight_sums))
    unflat = lambda a, like: a[:size].reshape(n_layers, n_experts).astype(like.dtype)
    return unflat(new_counts, counts), unflat(new_sums, weight_sums)
