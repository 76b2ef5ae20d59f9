"""The grouped MoE of a prompt chunk (many picks an expert) as a Triton grouped GEMM:
`moe_grouped_triton`, moe_grouped_reference's contract (tidejax.pallas.moe), called by
tidejax.ops.moe_grouped where its `prefill` choice names it (engine.moe_prefill).

The picks are sorted by slot into tiles of BM rows (moe_plan.plan_tiles), and moe_prefill_kernel
runs twice over them: gate_up with the activation fused (h [rows, I] bf16), then down with each
pick's weight applied ([rows, D] float32); the k picks of a token are summed in jnp (a gather of
their rows, no atomics: deterministic). Weights bf16 or MXFP4 (decoded in registers), dots bf16
with float32 accumulation; x and h enter them as bf16, so against the float32 reference expect
~1e-2 of the output's scale (bf16 activations and h), not the Pallas dots path's ~1e-5 (which
feeds h as two bf16 terms). gpt-oss's bias leaves and activation (tidejax.contract) are
compile-time options. With `demand`, the counters are counted by count_demand_reference in jnp.

On the GPU it is called through jax-triton (Pallas's Triton lowering is deprecated since jax
0.11); off it (interpret=True, tests) the same kernel runs in Triton's interpreter on the host,
through jax.pure_callback and torch tensors. bench/kernels.py --prefill times it beside the
Pallas dots path and the bf16 matmul peak (its first H100 run, bf16 experts: docs/DESIGN.md's
kernel table), --prefill-tiles at other tiles (`tile=`).
"""

from __future__ import annotations

import functools
import importlib.util
import math

import jax
import jax.numpy as jnp

from tidejax.contract import bank_format
from tidejax.pallas.bank import bank_dims
from tidejax.pallas.demand import Demand, count_demand_reference
from tidejax.pallas.moe import _check_args
from tidejax.pallas.moe_plan import picks_per_expert, plan_tiles, reach
from tidejax.pallas.triton_host import to_numpy, to_torch

# Tiles: BM rows (picks of one expert) x BN output columns, BK values of K a loop step; warps and
# pipeline stages a program. Untuned: chosen for Hopper's bf16 dots by rule of thumb
# (bench/kernels.py --prefill --prefill-tiles times the candidates of PREFILL_TILES there).
BM, BN, BK = 64, 128, 64
NUM_WARPS, NUM_STAGES = 4, 3


def _phases(bank) -> int:
    """Planes each activation row is split into: 1 (bf16 weights), 2 (MXFP4: even, odd inputs)."""
    return 1 if bank_format(bank) == "dense" else 2


def _block(dim: int, want: int) -> int:
    """The largest power of two <= want (a power of two) that divides dim."""
    return math.gcd(dim, want)


def _takes(bank) -> bool:
    """The bank's shapes and dtypes: hidden and intermediate multiples of 16 (tl.dot's least
    width; MXFP4's are multiples of 32 already), dense weights bf16."""
    _, d, i = bank_dims(bank)
    dense_ok = bank_format(bank) != "dense" or {jnp.dtype(bank[n].dtype) for n in
                                                ("gate_up", "down")} == {jnp.dtype(jnp.bfloat16)}
    return d % 16 == 0 and i % 16 == 0 and dense_ok


def triton_supports(bank, interpret: bool = False) -> bool:
    """Whether the kernel takes the bank here (`_takes`) and, on the GPU (not interpret),
    jax-triton is installed (the only way in)."""
    return _takes(bank) and (interpret or importlib.util.find_spec("jax_triton") is not None)


def fills_tiles(n_picks: int, n_slots: int) -> bool:
    """Whether a step's picks, spread evenly over the slots they use, fill at least a quarter of
    a BM-row tile an expert: a prompt chunk's (the grouped GEMM computes the rest of each tile
    for nothing). Untuned, like the tiles: DeepSeek-V4.1-Flash's chunks of 1,024 tokens and more
    (16 picks an expert) qualify, 512 (8) do not."""
    return picks_per_expert(n_picks, n_slots) >= BM / 4


def _projection(bank, name):
    """(weights, scales) operands of one projection: bf16 [N, R, K] (its own array again as the
    unused scales), or MXFP4 bytes [N, R, K / 2] and e8m0 scales [N, R, K / 32]."""
    if bank_format(bank) == "dense":
        return bank[name], bank[name]
    blocks = bank[name + "_blocks"]
    n, r, g, half = blocks.shape
    return blocks.reshape(n, r, g * half), bank[name + "_scales"]


def _deinterleaved(a, phases: int):
    """a [rows, K] -> each row's columns p, p + phases, ... for p < phases, one after another."""
    rows, k = a.shape
    return a.reshape(rows, k // phases, phases).swapaxes(1, 2).reshape(rows, k)


def _interpreted(*args, out_shape, grid, meta):
    """The kernel in Triton's interpreter on the host, its arguments in jax-triton's order (the
    arrays, then the output)."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from tidejax.pallas.moe_prefill_kernel import moe_prefill_kernel

    dtype = torch.bfloat16 if out_shape.dtype == jnp.bfloat16 else torch.float32
    out = torch.zeros(out_shape.shape, dtype=dtype)
    InterpretedFunction(moe_prefill_kernel.fn)[grid](*map(to_torch, args), out, **meta)
    return to_numpy(out)


def _launch(args, out_shape, grid, meta, warps_stages, interpret: bool):
    """The kernel over `grid`; on the GPU with warps_stages (num_warps, num_stages), which
    Triton's interpreter has no use for."""
    if interpret:
        return jax.pure_callback(functools.partial(_interpreted, out_shape=out_shape, grid=grid,
                                                   meta=meta), out_shape, *args)
    import jax_triton

    from tidejax.pallas.moe_prefill_kernel import moe_prefill_kernel

    num_warps, num_stages = warps_stages
    return jax_triton.triton_call(*args, kernel=moe_prefill_kernel, out_shape=out_shape,
                                  grid=grid, num_warps=num_warps, num_stages=num_stages, **meta)


@functools.partial(jax.jit, static_argnames=("swiglu_limit", "swiglu_alpha", "swiglu_up_shift",
                                             "interpret", "tile", "n_experts"))
def moe_grouped_triton(x, bank, slot_ids, weights, *, swiglu_limit: float = 0.0,
                       swiglu_alpha: float = 1.0, swiglu_up_shift: float = 0.0,
                       demand: Demand | None = None, interpret: bool = False,
                       tile: tuple[int, int, int, int, int] | None = None,
                       n_experts: int | None = None):
    """moe_grouped_reference's result by the Triton grouped GEMM (same shapes and arguments): x
    [T, D], bank (bf16 or MXFP4, optional bias leaves), slot_ids [T, k] int32 (-1 = skip),
    weights [T, k] -> y [T, D] of x.dtype; with `demand`, (y, counts, weight_sums).
    tile: (BM, BN, BK, num_warps, num_stages) instead of the module's (benchmarks): powers of
    two, BM and BN >= 16 (tl.dot's least), BK >= 16 a phase (MXFP4: 32); BN and BK clipped to
    what divides their dimension.
    n_experts: the distinct slots the picks can name where fewer than the bank's (a layer's
    experts in a bank of several layers' slots): they bound the tiles; None: the bank's."""
    bm, bn, bk, warps, stages = tile or (BM, BN, BK, NUM_WARPS, NUM_STAGES)
    least = (16, 16, 16 * _phases(bank))
    if any(v < lo or v & (v - 1) for v, lo in zip((bm, bn, bk), least)):
        raise ValueError(f"moe_grouped (triton): tile={tile}; want BM, BN, BK powers of two of "
                         f"at least {least} for this bank")
    n = _check_args(x, bank, slot_ids, weights, demand)
    _, d, i = bank_dims(bank)
    if not _takes(bank):
        raise ValueError(f"moe_grouped (triton): bank of hidden {d}, intermediate {i} "
                         f"({bank_format(bank)}); want multiples of 16 and, dense, bf16 weights")
    t, k = slot_ids.shape
    phases = _phases(bank)
    tile_slot, row_token, pick_row = plan_tiles(slot_ids, n, bm, reach(n, n_experts))
    rows = row_token.shape[0]
    # a skipped pick's row is past the end: its weight dropped
    row_weight = jnp.zeros(rows, jnp.float32).at[pick_row].set(
        weights.reshape(-1).astype(jnp.float32), mode="drop")
    common = dict(PHASES=phases, BM=bm, LIMIT=float(swiglu_limit), ALPHA=float(swiglu_alpha),
                  UP_SHIFT=float(swiglu_up_shift), DOT_F32=interpret)
    plan = (tile_slot, row_token, row_weight)

    def bias(name, like):  # the bias leaf, or (unused) the weights again
        return bank[name] if name in bank else like

    gate_up, gate_up_scales = _projection(bank, "gate_up")
    bn1, bk1 = _block(i, bn), _block(d, bk)
    h = _launch((_deinterleaved(x.astype(jnp.bfloat16), phases), *plan, gate_up, gate_up_scales,
                 bias("gate_up_bias", gate_up)),
                jax.ShapeDtypeStruct((rows, i), jnp.bfloat16), (i // bn1, tile_slot.shape[0]),
                dict(common, K=d, R=2 * i, N=i, BN=bn1, BK=bk1, GATE_UP=True,
                     BIAS="gate_up_bias" in bank), (warps, stages), interpret)
    down, down_scales = _projection(bank, "down")
    bn2, bk2 = _block(d, bn), _block(i, bk)
    out = _launch((h, *plan, down, down_scales, bias("down_bias", down)),
                  jax.ShapeDtypeStruct((rows, d), jnp.float32), (d // bn2, tile_slot.shape[0]),
                  dict(common, K=i, R=d, N=d, BN=bn2, BK=bk2, GATE_UP=False,
                       BIAS="down_bias" in bank), (warps, stages), interpret)
    # each pick's weighted row; a skipped pick's row is past the end: zeros
    per_pick = jnp.take(out, pick_row, axis=0, mode="fill", fill_value=0.0)  # [T * k, D]
    y = jnp.sum(per_pick.reshape(t, k, d), axis=1).astype(x.dtype)
    return y if demand is None else (y, *count_demand_reference(*demand))
