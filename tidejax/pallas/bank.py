"""The routed-expert bank as the kernels see it: format detection and per-slot dequantization.

dense:  {"gate_up": [N, 2I, D], "down": [N, D, I]}  (bf16 or float32; gate rows, then up rows)
mxfp4:  {"gate_up_blocks": [N, 2I, D/32, 16], "gate_up_scales": [N, 2I, D/32],
         "down_blocks": [N, D, I/32, 16], "down_scales": [N, D, I/32]}  (uint8)

Logical axes (`expert_axes`, for tidejax.parallel): N is "slots" in the bank, "experts" in the
host pool; D is "embed"; 2I and I are "ffw", which the sharding table splits over "tensor".

Tensor parallelism and gate_up: a split of the 2I rows into T contiguous blocks must give each
device the gate rows AND the up rows of the same I/T intermediate units, so its swiglu and its
slice of down ([N, D, I/T]) need nothing from another device. Today's layout (all gate rows, then
all up rows) does not: for T = 2 one device would hold every gate row and the other every up row.
The layout that split needs is gate and up interleaved by tensor block,
[N, T, 2, I/T, D] flattened to [N, 2I, D] (block t = gate rows t*I/T.. then up rows t*I/T..;
T = 1 is today's layout), or row by row ([N, I, 2, D]: right for any T). The change lives where
rows enter the pool (tidejax.models.loading.ExpertPool) and where the kernels split h into gate
and up (jnp.split(h, 2) in tidejax.pallas.moe and the grouped kernel); the kernels keep today's
layout until a mesh with tensor > 1 is served.
"""

from __future__ import annotations

import jax.numpy as jnp

from tidejax.checkpoint import mxfp4

DENSE_KEYS = frozenset({"gate_up", "down"})
MXFP4_KEYS = frozenset({"gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"})


def expert_axes(bank, rows: str = "slots") -> dict:
    """The logical axes of each leaf of a bank (rows "slots") or host pool (rows "experts")."""
    bank_format(bank)  # checks the keys
    gate_up, down = (rows, "ffw", "embed"), (rows, "embed", "ffw")  # [N, 2I, D], [N, D, I]
    by_name = {"gate_up": gate_up, "down": down, "gate_up_blocks": gate_up + (None,),
               "gate_up_scales": gate_up, "down_blocks": down + (None,), "down_scales": down}
    return {name: by_name[name] for name in bank}


def bank_format(bank) -> str:
    """'dense' or 'mxfp4', from the leaf names; anything else is an error naming the keys."""
    keys = frozenset(bank)
    if keys == DENSE_KEYS:
        return "dense"
    if keys == MXFP4_KEYS:
        return "mxfp4"
    raise ValueError(
        f"expert bank has keys {sorted(keys)}; expected {sorted(DENSE_KEYS)} (dense) "
        f"or {sorted(MXFP4_KEYS)} (mxfp4)"
    )


def bank_dims(bank) -> tuple[int, int, int]:
    """(slots N, hidden D, intermediate I) of a bank of either format, with shape checks."""
    if bank_format(bank) == "dense":
        n, two_i, d = bank["gate_up"].shape
        want_down = (n, d, two_i // 2)
        got_down = tuple(bank["down"].shape)
    else:
        n, two_i, g, _ = bank["gate_up_blocks"].shape
        d = g * mxfp4.BLOCK
        want_down = (n, d, two_i // 2 // mxfp4.BLOCK, mxfp4.BLOCK // 2)
        got_down = tuple(bank["down_blocks"].shape)
    if two_i % 2 or got_down != want_down:
        raise ValueError(f"expert bank: down has shape {got_down}, expected {want_down}")
    return n, d, two_i // 2


def dequantized(bank, dtype=jnp.float32) -> dict:
    """{"gate_up", "down"} of `dtype` for every row of `bank` (a bank or a gathered part of one)."""
    if bank_format(bank) == "dense":
        return {"gate_up": bank["gate_up"].astype(dtype), "down": bank["down"].astype(dtype)}
    return {
        "gate_up": mxfp4.dequantize(bank["gate_up_blocks"], bank["gate_up_scales"], dtype),
        "down": mxfp4.dequantize(bank["down_blocks"], bank["down_scales"], dtype),
    }
