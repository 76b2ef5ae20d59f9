"""TEMPORARY: the kernel as of c1b42fe, kept only so that bench/kernels.py --variants can time the
new kernel (moe_kernel.py) against it in one GPU run; deleted once the numbers are in.

Pallas (Triton lowering) kernel for `moe_grouped`: picks grouped by bank slot into row tiles.

Plan (jnp, cheap): the T*k picks are sorted by slot and laid out in tiles of `bt` rows, every
tile holding picks of one slot (a slot's last tile is padded). Then two kernels, each a grid over
(tile, output columns); a program streams its slot's weight rows once, dequantizing MXFP4 in
registers, and serves all rows of its tile with bf16 dots accumulated in float32:
  1. h[row] = swiglu(x[token(row)] @ gate_up[slot].T)      [rows, I] bf16
  2. o[row] = h[row] @ down[slot].T                        [rows, D] f32
Finally y[t] = sum_j w[t, j] * o[row of pick (t, j)] (a gather, no atomics: deterministic).
Tiles past the used ones have slot -1 and return at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tidejax.checkpoint import mxfp4
from tidejax.pallas import triton_offsets  # noqa: F401  (64-bit offsets for 2**31+ element refs)
from tidejax.pallas.bank import bank_dims, bank_format

# Tile by bank format and rows per tile bt: (bt, block of output columns, block of K, num_warps,
# num_stages). Small bt = decode (weight streaming), large bt = prefill (matrix units). Chosen
# by bench/kernels.py sweeps on the H200 (bench/RESULTS.md).
TILES = {
    "dense": {16: (16, 32, 256, 4, 4), 32: (32, 64, 128, 4, 4), 64: (64, 256, 64, 8, 3)},
    "mxfp4": {16: (16, 64, 128, 4, 1), 32: (32, 64, 128, 4, 4), 64: (64, 64, 128, 4, 2)},
}


def rows_per_tile(n_picks: int, n_slots: int) -> int:
    """Average picks a used slot gets decides the tile height (a power of two, >= 16)."""
    avg = n_picks / max(1, min(n_slots, n_picks))
    return 16 if avg <= 16 else 32 if avg <= 32 else 64


def pallas_supports(bank) -> bool:
    """Whether the kernel takes the bank's shapes: hidden and intermediate (per phase) % 16 == 0."""
    _, d, i = bank_dims(bank)
    phases = 1 if bank_format(bank) == "dense" else 2
    return d % 16 == 0 and i % (16 * phases) == 0


def _block(dim: int, want: int, what: str) -> int:
    """Largest power of two <= want that divides dim (Triton blocks are powers of two, >= 16)."""
    b = want
    while b >= 16 and dim % b:
        b //= 2
    if b < 16:
        raise ValueError(f"moe_grouped(impl='pallas'): {what} {dim} is not a multiple of 16")
    return b


def plan_tiles(slot_ids, n_slots: int, bt: int):
    """Group picks by slot into tiles of bt rows.

    Returns tile_slot [n_tiles] (slot or -1 = unused tile), row_token [n_tiles*bt] (token of each
    row; padding rows point at token 0) and pick_row [T*k] (row of each pick; skipped picks
    point past the end).
    """
    t, k = slot_ids.shape
    n_picks = t * k
    n_tiles = (n_picks + min(n_slots, n_picks) * (bt - 1)) // bt  # upper bound, static
    key = jnp.where(slot_ids.reshape(-1) >= 0, slot_ids.reshape(-1), n_slots)  # [P]
    order = jnp.argsort(key, stable=True)  # picks sorted by slot, skipped ones last
    counts = jnp.bincount(key, length=n_slots + 1)[:n_slots]  # picks per slot
    tiles = (counts + bt - 1) // bt
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    pick_start = jnp.cumsum(counts) - counts
    sorted_key = key[order]
    s = jnp.minimum(sorted_key, n_slots - 1)
    rank = jnp.arange(n_picks) - pick_start[s]
    row = jnp.where(sorted_key < n_slots, tile_start[s] * bt + rank, n_tiles * bt)
    pick_row = jnp.zeros(n_picks, jnp.int32).at[order].set(row.astype(jnp.int32))
    row_token = jnp.zeros(n_tiles * bt, jnp.int32).at[row].set(order // k, mode="drop")
    tile_slot = jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right").astype(jnp.int32)
    tile_slot = jnp.where(tile_slot < n_slots, tile_slot, -1)
    return tile_slot, row_token, pick_row


def _e2m1_over_2_to_14(nibbles):
    """int32 e2m1 codes (0..15) -> float32 value * 2**-14, in a few integer ops.

    The code's exponent and mantissa bits, moved to the top of an fp16's exponent and mantissa
    fields, read as fp16 (subnormal for exponent 0, exactly as e2m1's) the value times 2**-14.
    """
    bits = ((nibbles & 7) << 9) | ((nibbles & 8) << 12)
    half = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)
    return half.astype(jnp.float32)


def _step_start(kk, size):
    """kk * size, marked a multiple of size for Triton (vector loads); kk may be a Python int."""
    return kk * size if isinstance(kk, int) else pl.multiple_of(kk * size, size)


def _fetch(w_refs, slot, rows, kk, bk):
    """Raw operands of K step kk for weight rows `rows` (a pl.ds) of one slot.

    dense -> (tile [bn, bk],); mxfp4 -> (bytes [bn, bk/2], scale bytes [bn, bk/32]).
    """
    if len(w_refs) == 1:  # dense
        return (w_refs[0][slot, rows, pl.ds(_step_start(kk, bk), bk)],)
    blocks_ref, scales_ref = w_refs  # [N, R, K/2] uint8, [N, R, K/32] uint8
    nbytes, nb = bk // 2, bk // mxfp4.BLOCK
    packed = blocks_ref[slot, rows, pl.ds(_step_start(kk, nbytes), nbytes)]
    return packed, scales_ref[slot, rows, pl.ds(_step_start(kk, nb), nb)]


def _decode(raw):
    """Raw operands -> bf16 weights as phases of K.

    dense -> (w [bn, bk],); mxfp4 -> (w_even [bn, bk/2], w_odd [bn, bk/2]): the low nibbles
    hold the even inputs and the high nibbles the odd ones, so the dot takes x split the same
    way and the nibbles are never interleaved in registers.
    """
    if len(raw) == 1:
        return (raw[0].astype(jnp.bfloat16),)
    packed, exps = raw[0].astype(jnp.int32), raw[1].astype(jnp.int32)
    bn, nb = exps.shape
    # 2**(e - 127 + 14) as float32 bits (scales above 240, 2**113, saturate: no weight is that big)
    scale = jax.lax.bitcast_convert_type(jnp.minimum(exps + 14, 254) << 23, jnp.float32)
    half = mxfp4.BLOCK // 2  # bytes a block
    scale = jnp.broadcast_to(scale.reshape(bn, nb, 1), (bn, nb, half)).reshape(bn, nb * half)
    lo = _e2m1_over_2_to_14(packed & 15) * scale
    hi = _e2m1_over_2_to_14(packed >> 4) * scale
    return lo.astype(jnp.bfloat16), hi.astype(jnp.bfloat16)


def _k_loop(n_k, fetch, consume, acc, prefetch):
    """acc = consume(kk, fetch(kk), acc) for kk < n_k.

    With prefetch, step kk+1's loads are issued before step kk's math (double buffering in
    registers): MXFP4 bytes go through integer math before the dot, so Triton's own pipelining,
    which feeds dots from shared memory, does not hide their latency.
    """
    if not prefetch:
        return jax.lax.fori_loop(0, n_k, lambda kk, a: consume(kk, fetch(kk), a), acc)

    def step(kk, carry):
        a, raw = carry
        following = fetch(jnp.minimum(kk + 1, n_k - 1))  # the last step re-reads its own tile
        return consume(kk, raw, a), following

    return jax.lax.fori_loop(0, n_k, step, (acc, fetch(0)))[0]


def _dot_t(a, b):
    """a [m, k] @ b[n, k].T in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _phase_rows(col, bn, n_rows, phases):
    """Program `col` of a projection with n_rows outputs, its phase and the rows it makes.

    With 2 phases (MXFP4) the programs of phase p make the rows p, p+2, ...: their outputs are
    the even / odd inputs of the next projection, stored apart so that it needs no interleave.
    """
    per_phase = n_rows // (phases * bn)
    phase, q0 = col // per_phase, (col % per_phase) * bn
    return phase, q0, pl.ds(phases * q0 + phase, bn, stride=phases)


def _gate_up_kernel(tile_slot_ref, row_token_ref, *refs, bt, bn, bk, d, i, limit, phases):
    x_refs, w_refs, h_ref = refs[:phases], refs[phases:-1], refs[-1]
    tile, col = pl.program_id(0), pl.program_id(1)
    slot = tile_slot_ref[tile]

    @pl.when(slot >= 0)
    def _():
        tokens = row_token_ref[pl.ds(tile * bt, bt)]
        phase, q0, rows = _phase_rows(col, bn, i, phases)
        up_rows = pl.ds(i + rows.start, bn, stride=phases)
        kx = bk // phases  # x columns a phase takes per step

        def fetch(kk):
            return _fetch(w_refs, slot, rows, kk, bk), _fetch(w_refs, slot, up_rows, kk, bk)

        def consume(kk, raw, acc):
            g, u = acc
            x0 = _step_start(kk, kx)
            xs = [r[tokens, pl.ds(x0, kx)].astype(jnp.bfloat16) for r in x_refs]
            for xp, wp in zip(xs, _decode(raw[0])):
                g = g + _dot_t(xp, wp)
            for xp, wp in zip(xs, _decode(raw[1])):
                u = u + _dot_t(xp, wp)
            return g, u

        zeros = jnp.zeros((bt, bn), jnp.float32)
        g, u = _k_loop(d // bk, fetch, consume, (zeros, zeros), prefetch=phases > 1)
        if limit > 0:
            g = jnp.minimum(g, limit)
            u = jnp.clip(u, -limit, limit)
        h = g * jax.nn.sigmoid(g) * u
        h_ref[phase, pl.ds(tile * bt, bt), pl.ds(q0, bn)] = h.astype(h_ref.dtype)


def _down_kernel(tile_slot_ref, h_ref, *refs, bt, bn, bk, i, phases):
    *w_refs, o_ref = refs
    tile, col = pl.program_id(0), pl.program_id(1)
    slot = tile_slot_ref[tile]

    @pl.when(slot >= 0)
    def _():
        kh = bk // phases  # activation columns a phase takes per step

        def consume(kk, raw, acc):
            h0 = _step_start(kk, kh)
            for p, wp in enumerate(_decode(raw)):
                acc = acc + _dot_t(h_ref[p, pl.ds(tile * bt, bt), pl.ds(h0, kh)], wp)
            return acc

        fetch = lambda kk: _fetch(w_refs, slot, pl.ds(col * bn, bn), kk, bk)
        acc = _k_loop(i // bk, fetch, consume, jnp.zeros((bt, bn), jnp.float32), prefetch=phases > 1)
        o_ref[pl.ds(tile * bt, bt), pl.ds(col * bn, bn)] = acc


def _weight_refs(bank, name):
    """Kernel operands of one projection: (dense,) or (blocks as [N, R, K/2], scales)."""
    if bank_format(bank) == "dense":
        return (bank[name],)
    blocks = bank[name + "_blocks"]
    n, r, g, _ = blocks.shape
    return blocks.reshape(n, r, g * mxfp4.BLOCK // 2), bank[name + "_scales"]


@functools.partial(jax.jit, static_argnames=("swiglu_limit", "interpret", "tile"))
def moe_grouped_pallas(x, bank, slot_ids, weights, *, swiglu_limit: float = 0.0, interpret=False,
                       tile=None):
    """Same contract as `moe_grouped_reference`; bf16 dots with float32 accumulation.

    tile: (bt, bn, bk, num_warps, num_stages) to override the choice from TILES (benchmarks).
    """
    n, d, i = bank_dims(bank)
    t, k = slot_ids.shape
    bt, bn, bk, num_warps, num_stages = tile or TILES[bank_format(bank)][rows_per_tile(t * k, n)]
    tile_slot, row_token, pick_row = plan_tiles(slot_ids, n, bt)
    rows = row_token.shape[0]
    n_tiles = tile_slot.shape[0]
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    phases = 1 if bank_format(bank) == "dense" else 2
    xs = [x[:, p::phases] for p in range(phases)]  # [T, D / phases] each

    bn1, bk1 = _block(i // phases, bn, "moe intermediate / phases"), _block(d, bk, "hidden")
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, bt=bt, bn=bn1, bk=bk1, d=d, i=i, limit=swiglu_limit,
                          phases=phases),
        out_shape=jax.ShapeDtypeStruct((phases, rows, i // phases), jnp.bfloat16),
        grid=(n_tiles, i // bn1),
        compiler_params=params,
        interpret=interpret,
        name="moe_gate_up",
    )(tile_slot, row_token, *xs, *_weight_refs(bank, "gate_up"))

    bn2, bk2 = _block(d, bn, "hidden"), _block(i, bk, "moe intermediate")
    out = pl.pallas_call(
        functools.partial(_down_kernel, bt=bt, bn=bn2, bk=bk2, i=i, phases=phases),
        out_shape=jax.ShapeDtypeStruct((rows, d), jnp.float32),
        grid=(n_tiles, d // bn2),
        compiler_params=params,
        interpret=interpret,
        name="moe_down",
    )(tile_slot, h, *_weight_refs(bank, "down"))

    picked = jnp.take(out, pick_row, axis=0, mode="clip").reshape(t, k, d)
    picked = jnp.where((slot_ids >= 0)[:, :, None], picked, 0.0)  # rows never written: skip
    return jnp.sum(weights.astype(jnp.float32)[:, :, None] * picked, axis=1).astype(x.dtype)
