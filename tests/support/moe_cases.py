"""Grouped-MoE test cases shared by the kernels' tests (tests/pallas): random banks of either
format with their float64 weights, picks, and a float64 numpy MoE to check against."""

import jax.numpy as jnp
import numpy as np

from tidejax.checkpoint import mxfp4


def make_bank(rng, fmt, n, d, i):
    """(bank, dense float64 gate_up [n, 2i, d], dense float64 down [n, d, i])."""
    gate_up = (rng.standard_normal((n, 2 * i, d)) / np.sqrt(d)).astype(np.float32)
    down = (rng.standard_normal((n, d, i)) / np.sqrt(i)).astype(np.float32)
    if fmt == "mxfp4":
        gb, gs = mxfp4.quantize(gate_up)
        db, ds = mxfp4.quantize(down)
        bank = {"gate_up_blocks": gb, "gate_up_scales": gs, "down_blocks": db, "down_scales": ds}
        return bank, mxfp4.dequantize(gb, gs, np.float64), mxfp4.dequantize(db, ds, np.float64)
    dtype = jnp.bfloat16 if fmt == "bf16" else jnp.float32
    bank = {"gate_up": jnp.asarray(gate_up, dtype), "down": jnp.asarray(down, dtype)}
    as64 = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    return bank, as64(bank["gate_up"]), as64(bank["down"])


def numpy_moe(x, gate_up, down, slot_ids, weights, limit, alpha=1.0, up_shift=0.0,
              gate_up_bias=None, down_bias=None):
    """Float64, one pick at a time: y[t] = sum_j w[t,j] * down_s(silu(g) * u); with alpha,
    up_shift and the biases gpt-oss's g * sigmoid(alpha * g) * (u + up_shift) and
    down_s(.) + down_bias_s over gate_up_s x + gate_up_bias_s."""
    x = np.asarray(x, np.float64)
    i = down.shape[-1]
    y = np.zeros_like(x)
    for t, j in zip(*np.nonzero(slot_ids >= 0)):
        s = slot_ids[t, j]
        h = gate_up[s] @ x[t] + (0 if gate_up_bias is None else gate_up_bias[s])
        g, u = h[:i], h[i:]
        if limit > 0:
            g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
        out = down[s] @ (g / (1 + np.exp(-alpha * g)) * (u + up_shift))
        y[t] += weights[t, j] * (out + (0 if down_bias is None else down_bias[s]))
    return y


def random_picks(rng, t, k, n):
    """Distinct slots per token, about a tenth of the picks skipped (-1)."""
    slot_ids = np.stack([rng.permutation(n)[:k] for _ in range(t)]).astype(np.int32)
    slot_ids[rng.random((t, k)) < 0.1] = -1
    return slot_ids, rng.random((t, k)).astype(np.float32)


def rel_err(got, want):
    return np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()


def gpt_oss_case(rng, fmt, n, slot_ids):
    """A bank of n slots with gpt-oss's bias leaves (tidejax.contract), tokens and weights for
    the picks slot_ids [T, k], and the float64 result of its clamped g * sigmoid(1.702 g) *
    (u + 1): (x, bank, weights, want, form)."""
    bank, gate_up, down = make_bank(rng, fmt, n, d=64, i=32)
    bank["gate_up_bias"] = rng.standard_normal((n, 64)).astype(np.float32)
    bank["down_bias"] = rng.standard_normal((n, 64)).astype(np.float32)
    x = rng.standard_normal((slot_ids.shape[0], 64)).astype(np.float32)
    weights = rng.random(slot_ids.shape).astype(np.float32)
    want = numpy_moe(x, gate_up, down, slot_ids, weights, 0.5, 1.702, 1.0,
                     bank["gate_up_bias"].astype(np.float64), bank["down_bias"].astype(np.float64))
    form = dict(swiglu_limit=0.5, swiglu_alpha=1.702, swiglu_up_shift=1.0)
    return x, bank, weights, want, form
