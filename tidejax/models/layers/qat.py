"""QAT fake quantizers (quantize, then dequantize), as DeepSeek-V4.1's reference applies them
inside attention: FP8 e4m3 with power-of-two block scales, FP4 e2m1 with e4m3 or power-of-two
block scales. Exact on every backend: the rounding is done in float32 arithmetic, never by a cast
to a float8 type (some backends round those twice, through float16, which moves ties).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
FP8_MAX = 448.0
FP4_MAX = 6.0
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def pow2_ceil(t):
    """2^ceil(log2(t)) for float32 t > 0 (normal range), from the bit pattern: exponent - 127,
    plus one when the mantissa is nonzero (the ue8m0 scale rule)."""
    bits = jax.lax.bitcast_convert_type(t.astype(F32), jnp.int32)
    k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type((k + 127) << 23, F32)


def round_e4m3(x):
    """Rounds float32 |x| <= 448 onto the float8_e4m3fn grid, to nearest, ties to even, in float32
    arithmetic. Exact on every backend: a plain `astype(float8_e4m3fn)` may round twice (through
    float16) on some, which moves ties."""
    x = x.astype(F32)
    bits = jax.lax.bitcast_convert_type(jnp.abs(x), jnp.int32)
    exponent = jnp.maximum(((bits >> 23) & 0xFF) - 127, -6)  # below 2^-6: the subnormal spacing
    ulp = jax.lax.bitcast_convert_type((exponent - 3 + 127) << 23, F32)  # 3 mantissa bits
    return jnp.round(x / ulp) * ulp  # jnp.round: half to even; the division by 2^k is exact


def _blocks(x, block: int):
    return x.astype(F32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fake_quant_fp8(x, block: int = 32):
    """e4m3 values with a power-of-two scale per block of channels; amax floored at 1e-4.
    A width the block does not divide passes unquantized (as in the reference)."""
    if x.shape[-1] % block:
        return x
    b = _blocks(x, block)
    scale = pow2_ceil(jnp.maximum(jnp.max(jnp.abs(b), -1), 1e-4) * (1.0 / FP8_MAX))[..., None]
    q = round_e4m3(jnp.clip(b / scale, -FP8_MAX, FP8_MAX))
    return (q * scale).reshape(x.shape).astype(x.dtype)


def _e2m1_round(q):
    """Rounds |q| <= 6 onto the e2m1 grid, ties to the even code: ties at 0.25, 1.25, 2.5, 5 go
    down, ties at 0.75, 1.75, 3.5 go up."""
    boundaries = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    ties_up = np.array([False, True, False, True, False, True, False])
    thresholds = np.where(ties_up, boundaries, np.nextafter(boundaries, np.float32(np.inf)))
    code = jnp.sum(jnp.abs(q)[..., None] >= jnp.asarray(thresholds), -1)
    value = jnp.asarray(_E2M1)[code]
    return jnp.where(jnp.signbit(q), -value, value)


def fake_quant_fp4(x, block: int, e4m3_scale: bool):
    """e2m1 values per block of channels. Scale: e4m3-rounded amax/6 (compressed KV, blocks of
    16) or the power-of-two ceiling of amax/6 (indexer q and k, blocks of 32)."""
    if x.shape[-1] % block:
        return x
    b = _blocks(x, block)
    amax = jnp.max(jnp.abs(b), -1)
    if e4m3_scale:
        scale = round_e4m3(jnp.minimum(jnp.maximum(amax, FP4_MAX * 2.0 ** -9) / FP4_MAX, FP8_MAX))
    else:
        scale = pow2_ceil(jnp.maximum(amax, FP4_MAX * 2.0 ** -126) * (1.0 / FP4_MAX))
    scale = scale[..., None]
    q = _e2m1_round(jnp.clip(b / scale, -FP4_MAX, FP4_MAX))
    return (q * scale).reshape(x.shape).astype(x.dtype)
