"""DeepSeek's native FP8 weights: `weight` in float8_e4m3fn and its block scales, one scale per
block of 128 x 128 (rows, cols) of the [out, in] weight (or config.json's weight_block_size),
w = fp8 * scale. Edge blocks are partial: the scale shape is [ceil(out / 128), ceil(in / 128)].
The scales are `X.weight_scale_inv` (DeepSeek-V3: float32) or `X.scale` (DeepSeek-V4.1: e8m0,
as float8_e8m0fnu or its raw uint8 bits, or float32).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from tidejax.checkpoint.mxfp4 import SCALE_BIAS  # e8m0: the same biased exponent

E4M3_MAX = 448.0
BLOCK = (128, 128)


def config_block(raw_config: dict) -> tuple[int, int]:
    """The scale block of a checkpoint's config.json (quantization_config.weight_block_size)."""
    return tuple((raw_config.get("quantization_config") or {}).get("weight_block_size", BLOCK))


SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.float8_e8m0fnu), np.dtype(np.uint8))


def scale_names(weight: str) -> tuple[str, str]:
    """The names the block scales of weight `X.weight` may have: X.weight_scale_inv, X.scale."""
    return weight + "_scale_inv", weight.removesuffix(".weight") + ".scale"


def scales_to_float32(scales: np.ndarray) -> np.ndarray:
    """Block scales as float32: raw uint8 e8m0 bits (a biased exponent), e8m0 or float."""
    if scales.dtype == np.uint8:
        return np.ldexp(np.float32(1), scales.astype(np.int32) - SCALE_BIAS)
    return scales.astype(np.float32)


def scale_shape(shape: tuple[int, int], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def dequantize_fp8_block(w: np.ndarray, scale_inv: np.ndarray,
                         block: tuple[int, int] = BLOCK) -> np.ndarray:
    """w [out, in] float8_e4m3fn, scale_inv [ceil(out/bo), ceil(in/bi)] -> float32 [out, in]."""
    if w.ndim != 2 or scale_inv.shape != scale_shape(w.shape, block):
        raise ValueError(f"weight {w.shape} needs scale_inv {scale_shape(w.shape, block)} "
                         f"for {block} blocks, got {scale_inv.shape}")
    out = np.empty(w.shape, np.float32)
    bo, bi = block
    scale = scale_inv.astype(np.float32)
    for r in range(scale.shape[0]):  # one row block at a time: small temporaries
        rows = out[r * bo:(r + 1) * bo]
        rows[...] = e4m3_to_float32(w[r * bo:(r + 1) * bo])
        rows *= np.repeat(scale[r], bi)[:w.shape[1]]
    return out


# every e4m3 code's exact value, from ml_dtypes (NaN at 0x7F and 0xFF)
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def e4m3_to_float32(q: np.ndarray) -> np.ndarray:
    """float8_e4m3fn -> float32, exact; ~10x faster than ml_dtypes' astype, which converts
    element by element. Normal codes become float32 bits by moving the exponent and mantissa
    fields and rebiasing (7 -> 127); subnormal and NaN codes take their value from a table."""
    x = q.view(np.uint8).astype(np.uint32)
    em = x & 0x7F  # exponent and mantissa fields, [4 bits | 3 bits]
    bits = ((em << 20) + np.uint32((127 - 7) << 23)) | ((x & 0x80) << 24)
    out = bits.view(np.float32)
    special = np.flatnonzero((em + 1) & 0x7F < 9)  # em in 0..7 (zero, subnormal) or 0x7F (NaN)
    out.reshape(-1)[special] = _E4M3_VALUES[x.reshape(-1)[special]]
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


def dividing_block(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The largest block dividing both `block` and `shape`: scales repeated onto it hold the
    same values, and its edge blocks are whole (the block is then shape / scale shape)."""
    return (math.gcd(shape[0], block[0]), math.gcd(shape[1], block[1]))


def scales_on_dividing_block(scales: np.ndarray, shape: tuple[int, int],
                             block: tuple[int, int]) -> np.ndarray:
    """Scales [ceil(out/bo), ceil(in/bi)] of `block` repeated onto dividing_block(shape, block):
    [out / do, in / di], the same scale at every element."""
    (do, di), (bo, bi) = dividing_block(shape, block), block
    rows = np.repeat(scales, bo // do, axis=0)[:shape[0] // do]
    return np.ascontiguousarray(np.repeat(rows, bi // di, axis=1)[:, :shape[1] // di])
