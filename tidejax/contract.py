"""The kernels' contract: what the routed experts' kernels (the Pallas one and the host's C one)
and mHC's, their references and the models agree on, in one module that imports nothing of
tidejax (no kernel, no reference: tests/test_layout.py), so each of them can import it.

Activation. `swiglu`: silu(g) * u of the gate and up projections, with g <= L and |u| <= L when
swiglu_limit L > 0 (DeepSeek-V4 / V4.1's clamp). The one definition the Pallas kernel, the jnp
reference, the host kernel's numpy fallback (tidejax.residency.cpu) and the models' dense and
shared-expert MLPs (layers/mlp.py) compute; the C kernel (residency/cpu_kernel.c) computes the
same in C.

Activation variant (gpt-oss): g * sigmoid(alpha * g) * (u + up_shift) with the same clamps;
alpha = 1, up_shift = 0 is silu(g) * u. The jnp reference, the Pallas kernel (compiled in only
where alpha != 1 or up_shift != 0) and the host's numpy path compute it; the C kernel takes only
the plain form (`plain`: the `cpu` and `auto` miss policies refuse the rest at load).

Bias. Optional leaves beside either format: gate_up_bias [N, 2I] (added to the gate_up
projection, same row order) and down_bias [N, D] (added to each expert's output before its
routing weight), both float (gpt-oss). The jnp reference, the Pallas kernel (a compile-time
option: a bank without them compiles no bias loads) and the host's numpy path add them; the C
kernel takes banks without them only. Under a tensor split down_bias would be summed once a
device: refused (interleave_gate_up).

    dense:  {"gate_up": [N, 2I, D], "down": [N, D, I]}  (bf16 or float32)
    mxfp4:  {"gate_up_blocks": [N, 2I, D/32, 16], "gate_up_scales": [N, 2I, D/32],
             "down_blocks": [N, D, I/32, 16], "down_scales": [N, D, I/32]}  (uint8; the layout
             of tidejax.checkpoint.mxfp4)

Gate/up layout. gate_up's 2I rows are the gate rows, then the up rows (the checkpoint's order);
`split_gate_up` cuts a [.., 2I] projection into the two. Logical axes (`expert_axes`, for
tidejax.parallel): N is "slots" in the bank, "experts" in the host pool; D is "embed"; 2I and I
are "ffw", which the sharding table splits over "tensor".

Tensor parallelism: a split of the 2I rows into T contiguous blocks must give each device the
gate rows AND the up rows of the same I/T intermediate units, so its swiglu and its slice of
down ([N, D, I/T]) need nothing from another device. So rows enter the host pool interleaved by
tensor block (`interleave_gate_up`, tidejax.residency.pool.pool_rows): [N, T, 2, I/T, D]
flattened to [N, 2I, D], block t = gate rows t*I/T.. then up rows t*I/T.. (T = 1 is the
checkpoint's layout). Each device's shard is then a bank of the layout above (its gate rows, then
its up rows), which the kernels and references take as they are: with T > 1 they run only on
shards (tidejax.parallel.over_tensor in tidejax.residency.serve), never on the whole interleaved
bank.

mHC (DeepSeek-V4 / V4.1's hyper-connections, models/layers/mhc.py): `hc_project`, the float32
projection of the RMS-normalized flattened streams, and `hc_collapse`, the streams' weighted
sum, are what the fused front's kernel (pallas.mhc), its reference and the models (the final
head and collapse) compute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DENSE_KEYS = frozenset({"gate_up", "down"})
MXFP4_KEYS = frozenset({"gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"})
BIAS_KEYS = frozenset({"gate_up_bias", "down_bias"})


def swiglu(g, u, swiglu_limit: float, alpha: float = 1.0, up_shift: float = 0.0):
    """g * sigmoid(alpha * g) * (u + up_shift) of the gate and up projections (silu(g) * u with
    the defaults), with g <= L and |u| <= L when swiglu_limit L > 0 (the reference's and the
    kernels' one definition; numpy in, numpy out: the host kernel's fallback,
    tidejax.residency.cpu)."""
    xp = np if isinstance(g, np.ndarray) else jnp
    if swiglu_limit > 0:
        g = xp.minimum(g, swiglu_limit)
        u = xp.clip(u, -swiglu_limit, swiglu_limit)
    u = u + up_shift if up_shift else u
    if xp is np:
        with np.errstate(over="ignore"):  # exp(-g) = inf for g << 0: sigmoid 0, as wanted
            return g * (1 / (1 + np.exp(-alpha * g))) * u
    return g * jax.nn.sigmoid(alpha * g if alpha != 1.0 else g) * u


def hc_project(streams, fn, eps: float):
    """streams [..., hc, d] -> fn [outputs, hc * d] @ rms_normalize(flattened streams):
    [..., outputs] float32 (HIGHEST)."""
    flat = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, -1, keepdims=True) + eps)
    return jnp.einsum("...i,oi->...o", flat, fn.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def hc_collapse(streams, pre):
    """sum_j pre_j * X_j: [..., hc, d], [..., hc] -> [..., d] in the streams' dtype."""
    return jnp.sum(pre[..., None] * streams.astype(jnp.float32), -2).astype(streams.dtype)


def plain(bank, alpha: float = 1.0, up_shift: float = 0.0) -> bool:
    """Whether a bank and activation are what the host's C kernel takes (the Pallas kernel takes
    any): no bias leaves, silu(g) * u."""
    return not (BIAS_KEYS & set(bank)) and alpha == 1.0 and up_shift == 0.0


def split_gate_up(h):
    """A gate_up projection [..., 2I] -> (gate [..., I], up [..., I]): the gate rows come first."""
    xp = np if isinstance(h, np.ndarray) else jnp
    return tuple(xp.split(h, 2, axis=-1))


def bank_format(bank) -> str:
    """'dense' or 'mxfp4', from the leaf names (bias leaves aside); anything else is an error
    naming the keys."""
    keys = frozenset(bank) - BIAS_KEYS
    if keys == DENSE_KEYS:
        return "dense"
    if keys == MXFP4_KEYS:
        return "mxfp4"
    raise ValueError(
        f"expert bank has keys {sorted(keys)}; expected {sorted(DENSE_KEYS)} (dense) "
        f"or {sorted(MXFP4_KEYS)} (mxfp4), with {sorted(BIAS_KEYS)} optional"
    )


def expert_axes(bank, rows: str = "slots") -> dict:
    """The logical axes of each leaf of a bank (rows "slots") or host pool (rows "experts")."""
    bank_format(bank)  # checks the keys
    gate_up, down = (rows, "ffw", "embed"), (rows, "embed", "ffw")  # [N, 2I, D], [N, D, I]
    by_name = {"gate_up": gate_up, "down": down, "gate_up_blocks": gate_up + (None,),
               "gate_up_scales": gate_up, "down_blocks": down + (None,), "down_scales": down,
               "gate_up_bias": gate_up[:2], "down_bias": down[:2]}
    return {name: by_name[name] for name in bank}


def interleave_gate_up(row: dict, tensor: int) -> dict:
    """One expert row (leaves without the N axis: gate_up [2I, ...], down [D, ...]) with its
    gate_up rows interleaved by `tensor` blocks (module docstring); down is split along I as it
    is."""
    bank_format(row)  # checks the keys
    if "down_bias" in row and tensor > 1:
        raise ValueError("routed experts with a down_bias under distributed.tensor_parallel > 1 "
                         "are not supported (the bias would be summed once a device)")
    out = dict(row)
    for name in ("gate_up", "gate_up_blocks", "gate_up_scales", "gate_up_bias"):
        if name in row:
            leaf = row[name]
            two_i = leaf.shape[0]
            if two_i % (2 * tensor):
                raise ValueError(f"expert '{name}' has {two_i // 2} intermediate rows, not a "
                                 f"multiple of distributed.tensor_parallel = {tensor}")
            blocks = leaf.reshape(2, tensor, two_i // (2 * tensor), *leaf.shape[1:])
            out[name] = blocks.swapaxes(0, 1).reshape(leaf.shape)
    return out
