"""The FP8 block-scaled matmul of dense weights kept as stored (DeepSeek's e4m3 values and one
scale per (rows, cols) block of the [out, in] weight): y = x @ (w * scales)^T. Only the jnp
reference exists so far; it runs on every backend (XLA fuses the dequantize into the dot's
operand on the GPU: the weight is read from HBM as FP8); tidejax.ops.fp8_block_matmul runs it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def fp8_block_matmul_reference(x, w, scales, block: tuple[int, int]):
    """Dequantize w by its block scales in float32, then the dot in x's dtype, accumulated in
    float32."""
    (out, inn), (bo, bi) = w.shape, block
    blocks = w.astype(F32).reshape(out // bo, bo, inn // bi, bi)
    full = blocks * scales.astype(F32)[:, None, :, None]
    y = jnp.einsum("...i,oi->...o", x, full.reshape(out, inn).astype(x.dtype),
                   precision=jax.lax.Precision.HIGHEST, preferred_element_type=F32)
    return y.astype(x.dtype)
