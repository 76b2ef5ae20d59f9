"""The routed-expert bank as the kernels see it: format detection and per-slot dequantization.

dense:  {"gate_up": [N, 2I, D], "down": [N, D, I]}  (bf16 or float32; gate rows, then up rows)
mxfp4:  {"gate_up_blocks": [N, 2I, D/32, 16], "gate_up_scales": [N, 2I, D/32],
         "down_blocks": [N, D, I/32, 16], "down_scales": [N, D, I/32]}  (uint8)

Logical axes (`expert_axes`, for tidejax.parallel): N is "slots" in the bank, "experts" in the
host pool; D is "embed"; 2I and I are "ffw", which the sharding table splits over "tensor".

Tensor parallelism and gate_up: a split of the 2I rows into T contiguous blocks must give each
device the gate rows AND the up rows of the same I/T intermediate units, so its swiglu and its
slice of down ([N, D, I/T]) need nothing from another device. So rows enter the pool
(tidejax.runtime.build, before tidejax.models.loading.ExpertPool) interleaved by tensor block (`interleave_gate_up`):
[N, T, 2, I/T, D] flattened to [N, 2I, D], block t = gate rows t*I/T.. then up rows t*I/T..
(T = 1 is the checkpoint's layout). Each device's shard is then a bank of today's layout (its
gate rows, then its up rows), which the kernels and references take as they are: with T > 1
they run only on shards (tidejax.parallel.over_tensor in tidejax.residency.serve), never on the
whole interleaved bank.
"""

from __future__ import annotations

import jax.numpy as jnp

from tidejax.checkpoint import mxfp4

DENSE_KEYS = frozenset({"gate_up", "down"})
MXFP4_KEYS = frozenset({"gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"})


def expert_axes(bank, rows: str = "slots") -> dict:
    """The logical axes of each leaf of a bank (rows "slots") or host pool (rows "experts")."""
    bank_format(bank)  # checks the keys
    gate_up, down = (rows, "ffw", "embed"), (rows, "embed", "ffw")  # [N, 2I, D], [N, D, I]
    by_name = {"gate_up": gate_up, "down": down, "gate_up_blocks": gate_up + (None,),
               "gate_up_scales": gate_up, "down_blocks": down + (None,), "down_scales": down}
    return {name: by_name[name] for name in bank}


def interleave_gate_up(row: dict, tensor: int) -> dict:
    """One expert row (leaves without the N axis: gate_up [2I, ...], down [D, ...]) with its
    gate_up rows interleaved by `tensor` blocks (see above); down is split along I as it is."""
    bank_format(row)  # checks the keys
    out = dict(row)
    for name in ("gate_up", "gate_up_blocks", "gate_up_scales"):
        if name in row:
            leaf = row[name]
            two_i = leaf.shape[0]
            if two_i % (2 * tensor):
                raise ValueError(f"expert '{name}' has {two_i // 2} intermediate rows, not a "
                                 f"multiple of distributed.tensor_parallel = {tensor}")
            blocks = leaf.reshape(2, tensor, two_i // (2 * tensor), *leaf.shape[1:])
            out[name] = blocks.swapaxes(0, 1).reshape(leaf.shape)
    return out


def bank_format(bank) -> str:
    """'dense' or 'mxfp4', from the leaf names; anything else is an error naming the keys."""
    keys = frozenset(bank)
    if keys == DENSE_KEYS:
        return "dense"
    if keys == MXFP4_KEYS:
        return "mxfp4"
    raise ValueError(
        f"expert bank has keys {sorted(keys)}; expected {sorted(DENSE_KEYS)} (dense) "
        f"or {sorted(MXFP4_KEYS)} (mxfp4)"
    )


def bank_dims(bank) -> tuple[int, int, int]:
    """(slots N, hidden D, intermediate I) of a bank of either format, with shape checks."""
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
    return n, d, two_i // 2


def dequantized(bank, dtype=jnp.float32) -> dict:
    """{"gate_up", "down"} of `dtype` for every row of `bank` (a bank or a gathered part of one)."""
    if bank_format(bank) == "dense":
        return {"gate_up": bank["gate_up"].astype(dtype), "down": bank["down"].astype(dtype)}
    return {
        "gate_up": mxfp4.dequantize(bank["gate_up_blocks"], bank["gate_up_scales"], dtype),
        "down": mxfp4.dequantize(bank["down_blocks"], bank["down_scales"], dtype),
    }
