"""DeepSeek's native FP8 weights: `weight` in float8_e4m3fn and `weight_scale_inv` in float32,
one scale per block of 128 x 128 (rows, cols) of the [out, in] weight, w = fp8 * scale_inv.
Edge blocks are partial: the scale shape is [ceil(out / 128), ceil(in / 128)].
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0
BLOCK = (128, 128)


def scale_shape(shape: tuple[int, int], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def dequantize_fp8_block(w: np.ndarray, scale_inv: np.ndarray,
                         block: tuple[int, int] = BLOCK) -> np.ndarray:
    """w [out, in] float8_e4m3fn, scale_inv [ceil(out/bo), ceil(in/bi)] -> float32 [out, in]."""
    if w.ndim != 2 or scale_inv.shape != scale_shape(w.shape, block):
        raise ValueError(f"weight {w.shape} needs scale_inv {scale_shape(w.shape, block)} "
                         f"for {block} blocks, got {scale_inv.shape}")
    out = w.astype(np.float32)
    bo, bi = block
    scale = scale_inv.astype(np.float32)
    for r in range(scale.shape[0]):  # one row block at a time: no full-size scale expansion
        rows = out[r * bo:(r + 1) * bo]
        rows *= np.repeat(scale[r], bi)[:w.shape[1]]
    return out


def quantize_fp8_block(w: np.ndarray, block: tuple[int, int] = BLOCK
                       ) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] float -> (float8_e4m3fn [out, in], float32 scale_inv [ceil(out/bo),
    ceil(in/bi)]) with scale_inv = amax / 448 per block (1 for an all-zero block)."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_fp8_block takes a 2-D weight, got shape {w.shape}")
    (n_r, n_c), (bo, bi) = scale_shape(w.shape, block), block
    padded = np.zeros((n_r * bo, n_c * bi), np.float32)
    padded[:w.shape[0], :w.shape[1]] = w
    amax = np.abs(padded.reshape(n_r, bo, n_c, bi)).max(axis=(1, 3))  # [n_r, n_c]
    scale_inv = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale_inv, bo, axis=0), bi, axis=1)[:w.shape[0], :w.shape[1]]
    q = np.clip(w / full, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale_inv
