"""The routed-expert bank as the kernels see it: format detection and per-slot dequantization.

dense:  {"gate_up": [N, 2I, D], "down": [N, D, I]}  (bf16 or float32; gate rows, then up rows)
mxfp4:  {"gate_up_blocks": [N, 2I, D/32, 16], "gate_up_scales": [N, 2I, D/32],
         "down_blocks": [N, D, I/32, 16], "down_scales": [N, D, I/32]}  (uint8)
"""

from __future__ import annotations

import jax.numpy as jnp

from tidejax.checkpoint import mxfp4

DENSE_KEYS = frozenset({"gate_up", "down"})
MXFP4_KEYS = frozenset({"gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"})


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
