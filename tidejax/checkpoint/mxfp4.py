"""MXFP4 (OCP Microscaling, FP4 e2m1 elements) in the layout of published checkpoints.

blocks [..., n_blocks, 16] uint8: two e2m1 codes a byte, low nibble first (element 2i in the low
nibble, 2i+1 in the high one); scales [..., n_blocks] uint8: e8m0 exponents, bias 127. A block is
32 consecutive values along the last (input) dimension. Works on numpy arrays and on jax arrays
(also inside jit): the array module follows the inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # values per block (one e8m0 scale each)
SCALE_BIAS = 127
# value of each 4-bit e2m1 code: sign bit 3, exponent bits 2..1, mantissa bit 0
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
E2M1_EMAX = 2  # exponent of the largest e2m1 value (6 = 1.5 * 2**2)


def _xp(*arrays):
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def dequantize(blocks, scales, dtype=np.float32):
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> values [..., G * 32] of `dtype`."""
    xp = _xp(blocks, scales)
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"mxfp4: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
            f"(want blocks [..., G, {BLOCK // 2}] and scales [..., G])"
        )
    table = xp.asarray(E2M1_VALUES)
    codes = xp.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., G, 16, 2] low nibble first
    values = table[codes.astype(xp.int32)].reshape(*blocks.shape[:-1], BLOCK)
    exponents = scales.astype(xp.int32) - SCALE_BIAS
    values = xp.ldexp(values, exponents[..., None])  # exact: a power-of-two scale
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK).astype(dtype)


def _e2m1_codes(xp, scaled):
    """Round scaled values (|v| <= 6 after saturation) to the nearest e2m1 code, ties to even."""
    mag = xp.minimum(xp.abs(scaled), 6.0)
    # midpoints between neighbouring magnitudes; on a tie the even code (mantissa 0) wins
    ties_down = (0.25, 1.25, 2.5, 5.0)  # lower neighbour is even
    ties_up = (0.75, 1.75, 3.5)  # upper neighbour is even
    code = sum((mag > m).astype(xp.uint8) for m in ties_down)
    code = code + sum((mag >= m).astype(xp.uint8) for m in ties_up)
    sign = (scaled < 0).astype(xp.uint8) << 3
    return (code | sign).astype(xp.uint8)


def quantize(w):
    """w [..., n] (n a multiple of 32) -> (blocks [..., n/32, 16] uint8, scales [..., n/32] uint8).

    The scale of a block is 2**(floor(log2(amax)) - 2) as the OCP MX spec gives; values that
    land above 6 after scaling saturate to 6, the rest round to nearest, ties to even.
    """
    xp = _xp(w)
    if w.shape[-1] % BLOCK:
        raise ValueError(f"mxfp4: last dimension {w.shape[-1]} is not a multiple of {BLOCK}")
    wb = xp.asarray(w, dtype=xp.float32).reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = xp.max(xp.abs(wb), axis=-1)  # [..., G]
    safe = xp.where(amax > 0, amax, 1.0)
    exponent = xp.floor(xp.log2(safe)).astype(xp.int32) - E2M1_EMAX
    exponent = xp.where(amax > 0, exponent, 0)
    exponent = xp.clip(exponent, -SCALE_BIAS, SCALE_BIAS)
    scaled = xp.ldexp(wb, -exponent[..., None])
    codes = _e2m1_codes(xp, scaled)  # [..., G, 32]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(xp.uint8)
    scales = (exponent + SCALE_BIAS).astype(xp.uint8)
    return blocks, scales
