"""The FP8 block-scaled matmul of dense weights kept as stored (DeepSeek's e4m3 values and one
scale per (rows, cols) block of the [out, in] weight): y = x @ (w * scales)^T. No kernel yet: two
jnp forms, which tidejax.ops.fp8_block_matmul picks between by the rows of x.

- `fp8_block_matmul_reference` dequantizes the weight, then one dot. On the GPU XLA writes the
  dequantized weight out before the dot (a `loop_convert_fusion`: bench/RESULTS.md, 2026-12-06,
  V4.1's wq_b 88 us a layer for 42 MB of FP8 that the read ceiling passes in 14 us), which is
  noise beside a prompt chunk's dot but the whole cost of a decode step's.
- `fp8_block_matmul_few_rows` moves the scales onto the activations instead: one copy of x per
  block of output rows, each scaled by that block's scales, then a dot batched over the output
  blocks whose weight operand is the stored values converted and nothing else, which XLA's GPU
  dot fusion takes as it is. The scaled copies are (out / block rows) x rows x in values: small
  beside the weight while rows <= block rows / 8.
"""

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


def fp8_block_matmul_few_rows(x, w, scales, block: tuple[int, int]):
    """The same product with the scales applied to x (in float32, then x's dtype): for each block
    of output rows o, x scaled per input block by scales[o] against w's rows of that block
    converted to x's dtype, accumulated in float32."""
    (out, inn), (bo, bi) = w.shape, block
    lead = x.shape[:-1]
    rows = x.reshape(-1, inn // bi, bi).astype(F32)
    scaled = rows[None] * scales.astype(F32)[:, None, :, None]  # [out / bo, r, in / bi, bi]
    scaled = scaled.reshape(out // bo, -1, inn).astype(x.dtype)
    y = jnp.einsum("ori,obi->rob", scaled, w.reshape(out // bo, bo, inn).astype(x.dtype),
                   precision=jax.lax.Precision.HIGHEST, preferred_element_type=F32)
    return y.reshape(lead + (out,)).astype(x.dtype)
