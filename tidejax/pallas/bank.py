"""Reading a routed-expert bank of either format (tidejax.contract: its leaves and layout): its
dims, checked, and per-slot dequantization (the references and the host kernel's fallback)."""

from __future__ import annotations

import jax.numpy as jnp

from tidejax.checkpoint import mxfp4
from tidejax.contract import BIAS_KEYS, bank_format


def bank_dims(bank) -> tuple[int, int, int]:
    """(slots N, hidden D, intermediate I) of a bank of either format, with shape checks (the
    bias leaves' too)."""
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
    for name, want in (("gate_up_bias", (n, two_i)), ("down_bias", (n, d))):
        if name in bank and tuple(bank[name].shape) != want:
            raise ValueError(f"expert bank: {name} has shape {tuple(bank[name].shape)}, "
                             f"expected {want}")
    return n, d, two_i // 2


def dequantized(bank, dtype=jnp.float32) -> dict:
    """{"gate_up", "down"} of `dtype` for every row of `bank` (a bank or a gathered part of one),
    and its bias leaves where it has them."""
    biases = {k: bank[k].astype(dtype) for k in BIAS_KEYS & set(bank)}
    if bank_format(bank) == "dense":
        return {"gate_up": bank["gate_up"].astype(dtype), "down": bank["down"].astype(dtype),
                **biases}
    return {
        "gate_up": mxfp4.dequantize(bank["gate_up_blocks"], bank["gate_up_scales"], dtype),
        "down": mxfp4.dequantize(bank["down_blocks"], bank["down_scales"], dtype), **biases,
    }
