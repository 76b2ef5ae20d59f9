"""DeepSeek-V4.1 building blocks without parameters: the QAT fake quantizers, the interleaved
tail RoPE, the mHC mixes, and the position bookkeeping of the rings and compress groups.

All position logic is for ONE sequence whose chunk covers positions start..start+t-1 (the first
n_valid of them real); the model vmaps it over the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
FP8_MAX = 448.0
FP4_MAX = 6.0
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


# ---------------------------------------------------------------------------------------------
# QAT fake quantizers (quantize then dequantize), as the reference applies them inside attention


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


# ---------------------------------------------------------------------------------------------
# RoPE on the trailing channels, adjacent pairs, layout kept


def rope_angles(positions, inv_freq):
    """positions [...] int -> (cos, sin) [..., r/2] float32."""
    angles = positions.astype(F32)[..., None] * jnp.asarray(inv_freq, F32)
    return jnp.cos(angles), jnp.sin(angles)


def rope_tail(x, cos, sin, inverse: bool = False):
    """Rotates pairs (2m, 2m+1) of the trailing r channels of x [..., t, (h,) n] in place (the
    channel order is kept: the quantizer blocks and the grouped output see it). cos/sin
    [..., t, r/2]; inverse rotates by -angle."""
    if x.ndim == cos.ndim + 1:
        cos, sin = cos[..., None, :], sin[..., None, :]
    if inverse:
        sin = -sin
    r = 2 * cos.shape[-1]
    nope, rot = x[..., :-r], x[..., -r:].astype(F32)
    even, odd = rot[..., 0::2], rot[..., 1::2]
    rot = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], -1).reshape(rot.shape)
    return jnp.concatenate([nope, rot.astype(x.dtype)], -1)


# ---------------------------------------------------------------------------------------------
# mHC: pre / post / comb from one projection of the flattened streams, Sinkhorn on comb


def hc_mixes(streams, fn, base, scale, *, eps: float, hc_eps: float, iters: int):
    """streams [..., hc, d] -> pre [..., hc], post [..., hc], comb [..., hc(j), hc(k)]."""
    hc = streams.shape[-2]
    flat = streams.reshape(*streams.shape[:-2], -1).astype(F32)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, -1, keepdims=True) + eps)
    m = jnp.einsum("...i,oi->...o", flat, fn.astype(F32), precision=jax.lax.Precision.HIGHEST)
    pre = jax.nn.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * jax.nn.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*m.shape[:-1], hc, hc)
    comb = jax.nn.softmax(logits, -1) + hc_eps
    comb = comb / (jnp.sum(comb, -2, keepdims=True) + hc_eps)

    def sinkhorn(_, c):
        c = c / (jnp.sum(c, -1, keepdims=True) + hc_eps)
        return c / (jnp.sum(c, -2, keepdims=True) + hc_eps)

    comb = jax.lax.fori_loop(0, iters - 1, sinkhorn, comb)  # a loop: unrolled, it dominates compile time
    return pre, post, comb


def hc_collapse(streams, pre):
    """sum_j pre_j * X_j: [..., hc, d], [..., hc] -> [..., d]."""
    return jnp.sum(pre[..., None] * streams.astype(F32), -2).astype(streams.dtype)


def hc_expand(y, residual, post, comb):
    """out_k = post_k * y + sum_j comb[j, k] * R_j."""
    mixed = jnp.einsum("...jk,...jd->...kd", comb, residual.astype(F32),
                       precision=jax.lax.Precision.HIGHEST)
    return (post[..., None] * y.astype(F32)[..., None, :] + mixed).astype(residual.dtype)


# ---------------------------------------------------------------------------------------------
# Per-sequence position bookkeeping (vmapped over the batch by the model)


def ring_positions(start, slots: int):
    """Position held by each ring slot before the chunk (slot = position mod slots); -1 = empty."""
    last = start - 1
    pos = last - jnp.mod(last - jnp.arange(slots), slots)
    return jnp.where(pos >= 0, pos, -1)


def ring_update(ring, new, start, n_valid):
    """ring [slots, ...] <- the latest of new [t, ...] (positions start..start+n_valid-1) per slot."""
    slots, t = ring.shape[0], new.shape[0]
    end = start + n_valid - 1
    idx = end - jnp.mod(end - jnp.arange(slots), slots) - start  # chunk index of each slot's latest
    take = (idx >= 0).reshape((slots,) + (1,) * (ring.ndim - 1))
    return jnp.where(take, new[jnp.clip(idx, 0, t - 1)], ring)


def pool_groups(kv, gate, buf_kv, buf_gate, start, n_valid, ratio: int):
    """Softmax-gated pooling of ratio consecutive tokens per group, for every group the chunk
    touches; members before the chunk come from the buffer (slot = position mod ratio).
    kv, gate [t, c]; buf_* [ratio, c] -> latents [n, c], group ids [n], complete [n] bool."""
    t = kv.shape[0]
    n = t // ratio + 2
    group = start // ratio + jnp.arange(n)
    member = group[:, None] * ratio + jnp.arange(ratio)[None]  # [n, ratio] positions
    idx = member - start
    in_chunk = ((idx >= 0) & (idx < t))[..., None]
    safe = jnp.clip(idx, 0, t - 1)
    kv_m = jnp.where(in_chunk, kv[safe], buf_kv[None])
    gate_m = jnp.where(in_chunk, gate[safe], buf_gate[None])
    latent = jnp.sum(jax.nn.softmax(gate_m.astype(F32), 1) * kv_m.astype(F32), 1)
    complete = group * ratio + ratio - 1 <= start + n_valid - 1
    return latent, group, complete


def candidate_blocks(scores, newest, block: int, keep: int):
    """Level one of the two-level top-k: per query keep the `keep` best blocks of `block` entries
    (block score = max entry; the block of the newest visible entry is forced in).
    scores [t, g] with -inf where invisible; newest [t] (index of the newest visible entry, -1 when
    none) -> bool [t, g]."""
    t, g = scores.shape
    n_blocks = -(-g // block)
    padded = jnp.pad(scores, ((0, 0), (0, n_blocks * block - g)), constant_values=-jnp.inf)
    block_scores = padded.reshape(t, n_blocks, block).max(-1)
    last = jnp.floor_divide(newest, block)
    block_scores = jnp.where(jnp.arange(n_blocks)[None] == last[:, None], jnp.inf, block_scores)
    values, ids = jax.lax.top_k(block_scores, min(keep, n_blocks))
    kept = jnp.zeros((t, n_blocks), bool).at[jnp.arange(t)[:, None], ids].set(values > -jnp.inf)
    return jnp.repeat(kept, block, axis=1)[:, :g]


def top_k_select(scores, k: int):
    """The top min(k, g) scores of each row: ids [t, k'] int32 and valid [t, k'] (finite score)."""
    values, ids = jax.lax.top_k(scores, min(k, scores.shape[-1]))
    return ids.astype(jnp.int32), values > -jnp.inf


def selection_mask(ids, valid, g: int):
    """ids, valid [t, k] -> bool [t, g] (which entries a query may attend)."""
    t = ids.shape[0]
    return jnp.zeros((t, g), bool).at[jnp.arange(t)[:, None], ids].set(valid)


def scatter_rows(store, rows, at, keep):
    """store [b, G, c] <- rows [b, n, c] at entry ids at [b, n] where keep; others dropped."""
    at = jnp.where(keep, at, store.shape[1])
    return store.at[jnp.arange(store.shape[0])[:, None], at].set(rows.astype(store.dtype), mode="drop")
