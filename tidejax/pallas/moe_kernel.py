"""Pallas (Triton lowering) kernel for `moe_grouped`, in two shapes chosen by how many picks an
expert gets in the step (under uniform routing, from the static shapes):

* GEMV (decode: few picks, nearly all of distinct experts): one row a pick, no planning. Two
  kernels over (pick, output columns) stream the pick's expert once, each weight decoded in
  registers and used in float32 FMAs (no matrix units), summed over each 32-value block, times
  the block's scale: exact to float32 rounding. Skipped picks (slot -1) return at once.
* dots (prefill and busy decode steps): the picks are sorted by slot into tiles of `bt` rows
  (jnp; a slot's last tile is padded), and a program streams its slot's weight rows once for the
  whole tile, dequantized to bf16 in registers, bf16 dots with float32 accumulation; h enters
  the down projection as two bf16 terms, so bf16 activations give ~1e-5 (float32 ones are
  rounded to bf16: ~2e-3).
MXFP4 codes are decoded by inline PTX on the GPU (E2M1_PTX, two codes a shift-and-mask) and by jnp
in interpret mode; both give the same exact values.
Both run h[row] = swiglu(x[token(row)] @ gate_up[slot].T), then o[row] = h[row] @ down[slot].T,
and y[t] = sum_j w[t, j] * o[row of pick (t, j)] (a gather, no atomics: deterministic).
gpt-oss's experts (tidejax.contract): the activation's variant (alpha, up_shift) and the bias
leaves are compile-time options; gate_up_bias is added to g and u before the activation,
down_bias to o, in float32. A bank without them compiles to the plain kernels: no extra loads or
math.
With `demand`, the gate/up pass also counts the router's wanted picks into the residency
counters (atomic adds by its programs of column block 0), saving a kernel launch a layer.

The planning is not free on the GPU (a sort and a dozen small ops, ~0.2 ms a call on the H200,
more than the kernels at one token): hence GEMV without it where picks rarely share an expert.

Measured against the alternatives on the H200 (bench/RESULTS.md, session 4): a Mosaic GPU GEMV
(0.57-0.63 of the copy bandwidth for bf16 where this one reaches ~1.0; 0.40 for MXFP4 at 4
tokens against 0.51), and MXFP4 GEMVs on the tensor cores or in integer dot products (dp4a),
both slower. The MXFP4 GEMV is bound by instruction issue (~6 instructions a code), not memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tidejax.checkpoint import mxfp4
from tidejax.contract import bank_format, swiglu
from tidejax.pallas import triton_offsets  # noqa: F401  (64-bit offsets for 2**31+ element refs)
from tidejax.pallas.bank import bank_dims
from tidejax.pallas.demand import check_demand
from tidejax.pallas.moe_plan import picks_per_expert, plan_tiles, reach

# Tiles, one table for both bank formats: "gemv" (bt = 1) and the dots' tiles by rows a tile bt:
# (bt, block of output columns, block of K values, num_warps, num_stages). Chosen by
# bench/kernels.py sweeps on the H200 (bench/RESULTS.md); where the two formats' best tiles
# differ, they differ by a few percent.
TILES = {"gemv": (1, 32, 256, 4, 1), 16: (16, 64, 128, 4, 1), 32: (32, 64, 128, 4, 4),
         64: (64, 128, 64, 4, 4)}
# Values along K a GEMV thread reads as one 16-byte vector: a dense group of 8 bf16, an MXFP4
# block's 16 bytes (32 values: the low nibbles hold the even inputs, the high nibbles the odd).
GEMV_GROUP = {"dense": 8, "mxfp4": 16}
# GEMV reads an expert once per pick, the dots once per step: GEMV runs while the picks a used
# expert gets average at most this (H200: an MXFP4 expert costs the dots ~2.2x a GEMV pick, a bf16
# one ~1.4x; bench/RESULTS.md).
GEMV_MAX_PICKS_PER_EXPERT = {"dense": 1.15, "mxfp4": 2.0}


def choose_tile(fmt: str, n_picks: int, n_slots: int) -> tuple:
    """The tile for a step's picks: GEMV when experts are rarely shared, else dots whose tile
    height follows the picks a used expert gets."""
    avg = picks_per_expert(n_picks, n_slots)
    if avg <= GEMV_MAX_PICKS_PER_EXPERT[fmt]:
        return TILES["gemv"]
    return TILES[16 if avg <= 16 else 32 if avg <= 32 else 64]


def _phases(bank) -> int:
    """Planes the kernel splits K into: 1 (dense), 2 (MXFP4: the even and the odd inputs, low and
    high nibbles)."""
    return 1 if bank_format(bank) == "dense" else 2


def pallas_supports(bank) -> bool:
    """Whether the kernel takes the bank's shapes: hidden and intermediate (per phase) % 16 == 0."""
    _, d, i = bank_dims(bank)
    return d % 16 == 0 and i % (16 * _phases(bank)) == 0


def _block(dim: int, want: int, what: str, least: int = 16) -> int:
    """Largest power of two <= want that divides dim and is >= least."""
    b = want
    while b >= least and dim % b:
        b //= 2
    if b < least:
        raise ValueError(f"moe_grouped(impl='pallas'): {what} {dim} is not a multiple of {least}")
    return b


# ---- e2m1 codes -> floats ----------------------------------------------------------------------

def e2m1_f16_f32(b, shift):
    """uint32 bytes b -> float32 value * 2**-14 of the code in bits shift..shift+3 (0: a byte's
    low nibble, 4: its high nibble). The code's exponent and mantissa bits (2..0) land at the
    bottom of an fp16's exponent and the top of its mantissa, its sign bit on the sign: the fp16
    is the e2m1 value times 2**-14, exactly (exponent-0 codes, 0 and +-0.5, become fp16
    subnormals, which the conversion to float32 keeps)."""
    magnitude = (b << (9 - shift)) & jnp.uint32(7 << 9)
    sign = (b << (12 - shift)) & jnp.uint32(1 << 15)
    half = jax.lax.bitcast_convert_type((magnitude | sign).astype(jnp.uint16), jnp.float16)
    return half.astype(jnp.float32)


# The same decode in PTX, for the GPU: a 32-bit register holds 4 bytes, and each shift-and-mask
# makes two fp16s at once (the codes of bytes j and j + 2, one a 16-bit half), which the
# conversions widen to float32 (exact, subnormals kept). jnp's version spends ~6 integer ops a
# code (one byte a 32-bit register) and bound the GEMV by the integer ALU (0.30 of the copy
# bandwidth at 4 tokens); this ~2, and the GEMV is now bound by instruction issue (~0.5). One
# program a nibble (Pallas' inline asm returns one result): outputs $0-3 the nibble of bytes 0-3,
# input $4 the 4 bytes.
# PAIR_SHIFTS[nibble]: for the pair (bytes 0, 2) then (bytes 1, 3), the left shifts (negative:
# right) that bring the code's magnitude bits to 9-11 and its sign to 15 of each 16-bit half.
PAIR_SHIFTS = {0: ((9, 12), (1, 4)), 4: ((5, 8), (-3, 0))}
PAIR_MASKS = (0x0E000E00, 0x80008000)  # magnitude, sign bits of both halves


def _shift_ptx(dst, n):
    return f"shl.b32 {dst}, $4, {n};" if n >= 0 else f"shr.b32 {dst}, $4, {-n};"


def _e2m1_ptx(shifts):
    pairs = "".join(
        f"{_shift_ptx('t', m)} and.b32 t, t, {PAIR_MASKS[0]:#010x}; "
        f"{_shift_ptx('u', sign)} and.b32 u, u, {PAIR_MASKS[1]:#010x}; or.b32 p{j}, t, u;\n"
        for j, (m, sign) in enumerate(shifts))
    return ("{\n.reg .b32 t, u, p0, p1;\n.reg .b16 h<4>;\n" + pairs +
            "mov.b32 {h0, h1}, p0;\nmov.b32 {h2, h3}, p1;\n"
            "cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h2; cvt.f32.f16 $2, h1; cvt.f32.f16 $3, h3;\n}")


E2M1_PTX = {nibble: _e2m1_ptx(shifts) for nibble, shifts in PAIR_SHIFTS.items()}


def e2m1_nibbles(b, ptx: bool):
    """uint8 bytes -> (low nibbles', high nibbles') e2m1 values * 2**-14 as float32, exact.

    ptx: decode with E2M1_PTX (compiled kernels on the GPU); else with jnp (interpret mode)."""
    if not ptx:
        b = b.astype(jnp.uint32)
        return e2m1_f16_f32(b, 0), e2m1_f16_f32(b, 4)
    like = jax.ShapeDtypeStruct(b.shape, jnp.float32)
    return tuple(plgpu.elementwise_inline_asm(E2M1_PTX[shift], args=[b], constraints="=f,=f,=f,=f,r",
                                              pack=4, result_shape_dtypes=[like])[0]
                 for shift in (0, 4))


def _pow2_f32(e, bias, top):
    """float32 2**(e - bias) from int32 e; e clamped to <= top (no real weight is that big)."""
    return jax.lax.bitcast_convert_type((jnp.minimum(e, top) + 127 - bias) << 23, jnp.float32)


# ---- shared pieces -----------------------------------------------------------------------------

def _step_start(kk, size):
    """kk * size, marked a multiple of size for Triton (vector loads); kk may be a Python int."""
    return kk * size if isinstance(kk, int) else pl.multiple_of(kk * size, size)


def _k_loop(n_k, fetch, consume, acc, prefetch):
    """acc = consume(kk, fetch(kk), acc) for kk < n_k.

    With prefetch, step kk+1's loads are issued before step kk's math (double buffering in
    registers): the GEMVs' loads feed no dots and MXFP4 bytes go through integer math before
    use, so Triton's own pipelining, which feeds dots from shared memory, does not hide their
    latency (measured on the H200 with the GEMV: num_stages instead is within 3%).
    """
    if not prefetch:
        return jax.lax.fori_loop(0, n_k, lambda kk, a: consume(kk, fetch(kk), a), acc)

    def step(kk, carry):
        a, raw = carry
        following = fetch(jnp.minimum(kk + 1, n_k - 1))  # the last step re-reads its own tile
        return consume(kk, raw, a), following

    return jax.lax.fori_loop(0, n_k, step, (acc, fetch(0)))[0]


def _phase_rows(col, bn, n_rows, phases):
    """Program `col` of a projection with n_rows outputs, its phase and the rows it makes.

    With 2 phases (MXFP4) the programs of phase p make the rows p, p+2, ...: their outputs are
    the even / odd inputs of the next projection, stored apart so that it needs no interleave.
    """
    per_phase = n_rows // (phases * bn)
    phase, q0 = col // per_phase, (col % per_phase) * bn
    return phase, q0, pl.ds(phases * q0 + phase, bn, stride=phases)


# ---- demand counting (fused into the gate/up pass) ----------------------------------------------

def _counting(kernel, per_program, n_picks, k, n_experts):
    """`kernel` with the demand counting fused in. Refs: (layer [1], wanted ids [P], weights [P],
    token_mask [T], counts, sums, *the kernel's inputs, *its outputs, counts, sums), the counters
    flattened [L_moe * E] and aliased. The programs of column block 0 add the picks [program *
    per_program, + per_program) whether or not they have a slot, except padding tokens' and ids
    < 0: one scalar atomic add each, as a vector add's lanes may hit one cell (picks of one
    expert), which the GPU serves but interpret mode's discharge (a scatter-set) would not."""

    def counting_kernel(layer_ref, ids_ref, w_ref, mask_ref, _counts_in, _sums_in, *refs):
        *refs, counts_ref, sums_ref = refs
        first = pl.program_id(0) * per_program  # read outside the loop: interpret mode needs it

        @pl.when(pl.program_id(1) == 0)
        def _():
            def add(j, carry):
                pick = first + j
                at = jnp.minimum(pick, n_picks - 1)  # loads stay in bounds past the last pick
                wanted = ids_ref[at]

                @pl.when((pick < n_picks) & mask_ref[at // k] & (wanted >= 0))
                def _():
                    cell = layer_ref[0] * n_experts + wanted
                    plgpu.atomic_add(counts_ref, cell, jnp.float32(1.0))
                    plgpu.atomic_add(sums_ref, cell, w_ref[at].astype(jnp.float32))

                return carry

            jax.lax.fori_loop(0, per_program, add, 0)

        kernel(*refs)

    return counting_kernel


def _gate_up_call(kernel, *, demand, out_shape, grid, **call):
    """pl.pallas_call(kernel, ...) as a function of the operands -> (its output, counters): None
    without demand, else (counts, weight_sums) [L_moe, E] float32, counted inside the kernel."""
    if demand is None:
        return lambda *operands: (pl.pallas_call(kernel, out_shape=out_shape, grid=grid, **call)(*operands),
                                  None)
    shape = demand.counts.shape
    t, k = demand.ids.shape
    flat = jax.ShapeDtypeStruct((shape[0] * shape[1],), jnp.float32)
    counting = pl.pallas_call(_counting(kernel, -(-t * k // grid[0]), t * k, k, shape[1]),
                              out_shape=(out_shape, flat, flat), grid=grid,
                              input_output_aliases={4: 1, 5: 2}, **call)
    picks = (jnp.reshape(demand.layer, (1,)).astype(jnp.int32), demand.ids.reshape(-1).astype(jnp.int32),
             demand.weights.reshape(-1), demand.token_mask)

    def run(*operands):
        out, counts, sums = counting(*picks, demand.counts.reshape(-1), demand.weight_sums.reshape(-1),
                                     *operands)
        return out, (counts.reshape(shape), sums.reshape(shape))

    return run


# ---- GEMV (decode) -------------------------------------------------------------------------------
# Weights as [N, R, K/G, G] (G = GEMV_GROUP): a step takes [bn, nb, G] of them, one 16-byte
# vector a (row, group), and the activations' [nb, G] (x split into even / odd halves for MXFP4).
# The products are summed over G inside each thread, scaled per block, and accumulated [bn, nb];
# the sum over nb comes once, at the end. Program (pick, column block) serves one pick.

def _gemv_fetch(w_refs, slot, rows, kk, nb):
    g0 = _step_start(kk, nb)
    return tuple(ref[slot, rows, pl.ds(g0, nb)] for ref in w_refs)


def _gemv_weights(raw, ptx):
    """Raw operands -> (float32 planes [bn, nb, G] matching the activation phases, scale [bn, nb]).

    MXFP4 codes decode to value * 2**-14 (exact), the scale to 2**(e - 127 + 14)."""
    if len(raw) == 1:  # dense
        return (raw[0].astype(jnp.float32),), None
    return e2m1_nibbles(raw[0], ptx), _pow2_f32(raw[1].astype(jnp.int32), 113, 240)


def _gemv_partial(weights, xs):
    """[bn, nb] float32: per row and group, sum over G of weights * activations (then scaled)."""
    planes, scale = weights
    p = sum(jnp.sum(w * x[None], axis=2) for w, x in zip(planes, xs))
    return p if scale is None else p * scale


def _gemv_gate_up_kernel(pick_slot_ref, *refs, k, bn, nb, n_k, i, form, bias, phases, ptx):
    x_refs, w_refs, bias_ref, h_ref = _split_refs(refs, phases, bias)
    pick, col = pl.program_id(0), pl.program_id(1)
    slot = pick_slot_ref[pick]

    @pl.when(slot >= 0)
    def _():
        token = pick // k
        phase, q0, rows = _phase_rows(col, bn, i, phases)
        up_rows = pl.ds(i + rows.start, bn, stride=phases)

        def fetch(kk):
            return _gemv_fetch(w_refs, slot, rows, kk, nb), _gemv_fetch(w_refs, slot, up_rows, kk, nb)

        def consume(kk, raw, acc):
            g0 = _step_start(kk, nb)
            xs = [r[token, pl.ds(g0, nb)] for r in x_refs]
            gate, up = (_gemv_weights(w, ptx) for w in raw)
            return acc[0] + _gemv_partial(gate, xs), acc[1] + _gemv_partial(up, xs)

        zeros = jnp.zeros((bn, nb), jnp.float32)
        g, u = _k_loop(n_k, fetch, consume, (zeros, zeros), prefetch=True)
        g, u = jnp.sum(g, axis=1), jnp.sum(u, axis=1)
        if bias:
            g, u = _biased(g, bias_ref, slot, rows), _biased(u, bias_ref, slot, up_rows)
        h_ref[phase, pick, pl.ds(q0, bn)] = swiglu(g, u, *form)


def _gemv_down_kernel(pick_slot_ref, h_ref, *refs, bn, nb, n_k, bias, phases, ptx):
    _, w_refs, bias_ref, o_ref = _split_refs(refs, 0, bias)
    pick, col = pl.program_id(0), pl.program_id(1)
    slot = pick_slot_ref[pick]

    @pl.when(slot >= 0)
    def _():
        def consume(kk, raw, acc):
            g0 = _step_start(kk, nb)
            return acc + _gemv_partial(_gemv_weights(raw, ptx), [h_ref[p, pick, pl.ds(g0, nb)]
                                                            for p in range(phases)])

        fetch = lambda kk: _gemv_fetch(w_refs, slot, pl.ds(col * bn, bn), kk, nb)
        acc = _k_loop(n_k, fetch, consume, jnp.zeros((bn, nb), jnp.float32), prefetch=True)
        o = jnp.sum(acc, axis=1)
        cols = pl.ds(col * bn, bn)
        o_ref[pick, cols] = _biased(o, bias_ref, slot, cols) if bias else o


def _gemv_refs(bank, name, group):
    """Kernel operands of one projection as groups: (dense [N, R, K/G, G],) or (blocks, scales)."""
    if bank_format(bank) == "dense":
        return (_grouped(bank[name], group),)
    return bank[name + "_blocks"], bank[name + "_scales"]


def _grouped(a, group):
    """[..., K] -> [..., K / group, group]."""
    return a.reshape(*a.shape[:-1], a.shape[-1] // group, group)


def _split_refs(refs, n_in, bias: bool):
    """A kernel's refs after its scalar ones -> (the first n_in (activations), the weights',
    the bias leaf's or None, the output): the bias ref, where there is one, is the one just
    before the output."""
    end = -2 if bias else -1
    return refs[:n_in], refs[n_in:end], refs[-2] if bias else None, refs[-1]


def _bias_refs(bank, name) -> tuple:
    """The bias leaf `name` as a kernel operand: (bank[name],), or () where the bank has none."""
    return (bank[name],) if name in bank else ()


def _biased(v, bias_ref, slot, cols):
    """v [..., bn] float32 plus the bias of `slot` at `cols` (a pl.ds), broadcast over rows."""
    return v + bias_ref[slot, cols].astype(jnp.float32)


def _run_gemv(x, bank, slot_ids, demand, *, tile, form, interpret):
    """(per-pick outputs [T*k, D] float32 (rows of skipped picks unwritten), counters or None)."""
    fmt = bank_format(bank)
    _, d, i = bank_dims(bank)
    _, bn, bk, num_warps, num_stages = tile
    t, k = slot_ids.shape
    phases = _phases(bank)
    group = GEMV_GROUP[fmt]
    per_step = group * phases  # K values a group covers
    pick_slot = slot_ids.reshape(-1).astype(jnp.int32)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    xs = [_grouped(x.astype(jnp.float32)[:, p::phases], group) for p in range(phases)]

    bn1 = _block(i // phases, bn, "moe intermediate / phases", least=1)
    nb1 = _block(d // per_step, bk // per_step, "hidden groups", least=1)
    h, counters = _gate_up_call(
        functools.partial(_gemv_gate_up_kernel, k=k, bn=bn1, nb=nb1, n_k=d // per_step // nb1,
                          i=i, form=form, bias="gate_up_bias" in bank, phases=phases,
                          ptx=not interpret),
        out_shape=jax.ShapeDtypeStruct((phases, t * k, i // phases), jnp.float32),
        grid=(t * k, i // bn1),
        compiler_params=params,
        interpret=interpret,
        name="moe_gate_up_gemv",
        demand=demand,
    )(pick_slot, *xs, *_gemv_refs(bank, "gate_up", group), *_bias_refs(bank, "gate_up_bias"))

    bn2 = _block(d, bn, "hidden", least=1)
    nb2 = _block(i // per_step, bk // per_step, "moe intermediate groups", least=1)
    out = pl.pallas_call(
        functools.partial(_gemv_down_kernel, bn=bn2, nb=nb2, n_k=i // per_step // nb2,
                          bias="down_bias" in bank, phases=phases, ptx=not interpret),
        out_shape=jax.ShapeDtypeStruct((t * k, d), jnp.float32),
        grid=(t * k, d // bn2),
        compiler_params=params,
        interpret=interpret,
        name="moe_down_gemv",
    )(pick_slot, _grouped(h, group), *_gemv_refs(bank, "down", group),
      *_bias_refs(bank, "down_bias"))
    return out, counters


# ---- dots (prefill and busy decode steps) --------------------------------------------------------

def _dot_fetch(w_refs, slot, rows, kk, bk):
    """Raw operands of K step kk for weight rows `rows` (a pl.ds) of one slot.

    dense -> (tile [bn, bk],); mxfp4 -> (bytes [bn, bk/2], scale bytes [bn, bk/32]).
    """
    if len(w_refs) == 1:  # dense
        return (w_refs[0][slot, rows, pl.ds(_step_start(kk, bk), bk)],)
    blocks_ref, scales_ref = w_refs  # [N, R, K/2] uint8, [N, R, K/32] uint8
    nbytes, nb = bk // 2, bk // mxfp4.BLOCK
    packed = blocks_ref[slot, rows, pl.ds(_step_start(kk, nbytes), nbytes)]
    return packed, scales_ref[slot, rows, pl.ds(_step_start(kk, nb), nb)]


def _dot_weights(raw, ptx):
    """Raw operands -> bf16 weights as phases of K.

    dense -> (w [bn, bk],); mxfp4 -> (w_even [bn, bk/2], w_odd [bn, bk/2]): the low nibbles
    hold the even inputs and the high nibbles the odd ones, so the dot takes x split the same
    way and the nibbles are never interleaved in registers. Exact: codes value * 2**-14 times
    the scale 2**(e - 113) in float32, then bf16.
    """
    if len(raw) == 1:
        return (raw[0].astype(jnp.bfloat16),)
    e = raw[1].astype(jnp.int32)
    bn, nb = e.shape
    half = mxfp4.BLOCK // 2  # bytes a block
    scale = _pow2_f32(e, 113, 240).reshape(bn, nb, 1)
    scale = jnp.broadcast_to(scale, (bn, nb, half)).reshape(bn, nb * half)
    return tuple((w * scale).astype(jnp.bfloat16) for w in e2m1_nibbles(raw[0], ptx))


def _dot_t(a, b):
    """a [m, k] @ b[n, k].T in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_gate_up_kernel(tile_slot_ref, row_token_ref, *refs, bt, bn, bk, d, i, form, bias, phases,
                        ptx):
    x_refs, w_refs, bias_ref, h_ref = _split_refs(refs, phases, bias)
    tile, col = pl.program_id(0), pl.program_id(1)
    slot = tile_slot_ref[tile]

    @pl.when(slot >= 0)
    def _():
        tokens = row_token_ref[pl.ds(tile * bt, bt)]
        phase, q0, rows = _phase_rows(col, bn, i, phases)
        up_rows = pl.ds(i + rows.start, bn, stride=phases)
        kx = bk // phases  # x columns a phase takes per step

        def fetch(kk):
            return _dot_fetch(w_refs, slot, rows, kk, bk), _dot_fetch(w_refs, slot, up_rows, kk, bk)

        def consume(kk, raw, acc):
            x0 = _step_start(kk, kx)
            xs = [r[tokens, pl.ds(x0, kx)] for r in x_refs]
            return tuple(a + sum(_dot_t(xp, wp) for xp, wp in zip(xs, _dot_weights(w, ptx)))
                         for a, w in zip(acc, raw))

        zeros = jnp.zeros((bt, bn), jnp.float32)
        g, u = _k_loop(d // bk, fetch, consume, (zeros, zeros), prefetch=phases > 1)
        if bias:
            g, u = _biased(g, bias_ref, slot, rows), _biased(u, bias_ref, slot, up_rows)
        h_ref[phase, pl.ds(tile * bt, bt), pl.ds(q0, bn)] = swiglu(g, u, *form)


def _dot_down_kernel(tile_slot_ref, h_ref, *refs, bt, bn, bk, i, bias, phases, ptx):
    """h (float32) enters the bf16 dots as two terms, its bf16 rounding and the rest: ~16
    mantissa bits, so that bf16 inputs give the reference's outputs to ~1e-5, not ~2e-3."""
    _, w_refs, bias_ref, o_ref = _split_refs(refs, 0, bias)
    tile, col = pl.program_id(0), pl.program_id(1)
    slot = tile_slot_ref[tile]

    @pl.when(slot >= 0)
    def _():
        kh = bk // phases  # activation columns a phase takes per step

        def consume(kk, raw, acc):
            h0 = _step_start(kk, kh)
            for p, wp in enumerate(_dot_weights(raw, ptx)):
                h = h_ref[p, pl.ds(tile * bt, bt), pl.ds(h0, kh)]
                high = h.astype(jnp.bfloat16)
                low = (h - high.astype(jnp.float32)).astype(jnp.bfloat16)
                acc = acc + _dot_t(high, wp) + _dot_t(low, wp)
            return acc

        fetch = lambda kk: _dot_fetch(w_refs, slot, pl.ds(col * bn, bn), kk, bk)
        acc = _k_loop(i // bk, fetch, consume, jnp.zeros((bt, bn), jnp.float32), prefetch=phases > 1)
        rows, cols = pl.ds(tile * bt, bt), pl.ds(col * bn, bn)
        o_ref[rows, cols] = _biased(acc, bias_ref, slot, cols) if bias else acc


def _dot_refs(bank, name):
    """Kernel operands of one projection: (dense,) or (blocks as [N, R, K/2], scales)."""
    if bank_format(bank) == "dense":
        return (bank[name],)
    blocks = bank[name + "_blocks"]
    n, r, g, _ = blocks.shape
    return blocks.reshape(n, r, g * mxfp4.BLOCK // 2), bank[name + "_scales"]


def _run_dots(x, bank, slot_ids, demand, *, tile, form, interpret, named):
    """(per-pick outputs [T*k, D] float32, counters or None), through tiles of picks grouped by
    slot (at most `named` distinct ones)."""
    n, d, i = bank_dims(bank)
    t, k = slot_ids.shape
    bt, bn, bk, num_warps, num_stages = tile
    tile_slot, row_token, pick_row = plan_tiles(slot_ids, n, bt, named)
    rows, n_tiles = row_token.shape[0], tile_slot.shape[0]
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    phases = _phases(bank)
    xs = [x[:, p::phases].astype(jnp.bfloat16) for p in range(phases)]  # [T, D / phases] each

    bn1, bk1 = _block(i // phases, bn, "moe intermediate / phases"), _block(d, bk, "hidden")
    h, counters = _gate_up_call(
        functools.partial(_dot_gate_up_kernel, bt=bt, bn=bn1, bk=bk1, d=d, i=i, form=form,
                          bias="gate_up_bias" in bank, phases=phases, ptx=not interpret),
        out_shape=jax.ShapeDtypeStruct((phases, rows, i // phases), jnp.float32),
        grid=(n_tiles, i // bn1),
        compiler_params=params,
        interpret=interpret,
        name="moe_gate_up",
        demand=demand,
    )(tile_slot, row_token, *xs, *_dot_refs(bank, "gate_up"), *_bias_refs(bank, "gate_up_bias"))

    bn2, bk2 = _block(d, bn, "hidden"), _block(i, bk, "moe intermediate")
    out = pl.pallas_call(
        functools.partial(_dot_down_kernel, bt=bt, bn=bn2, bk=bk2, i=i, bias="down_bias" in bank,
                          phases=phases, ptx=not interpret),
        out_shape=jax.ShapeDtypeStruct((rows, d), jnp.float32),
        grid=(n_tiles, d // bn2),
        compiler_params=params,
        interpret=interpret,
        name="moe_down",
    )(tile_slot, h, *_dot_refs(bank, "down"), *_bias_refs(bank, "down_bias"))
    return jnp.take(out, pick_row, axis=0, mode="clip"), counters


@functools.partial(jax.jit, static_argnames=("swiglu_limit", "swiglu_alpha", "swiglu_up_shift",
                                             "interpret", "tile", "n_experts"))
def moe_grouped_pallas(x, bank, slot_ids, weights, *, swiglu_limit: float = 0.0,
                       swiglu_alpha: float = 1.0, swiglu_up_shift: float = 0.0, interpret=False,
                       tile=None, demand=None, n_experts: int | None = None):
    """Same contract as `moe_grouped_reference` (demand, the activation's variant and the bias
    leaves included: the gate/up kernel counts the demand).

    tile: (bt, bn, bk, num_warps, num_stages) to override `choose_tile` (benchmarks); bt = 1 runs
    the GEMV kernels, bt >= 16 the dots.
    n_experts: the distinct slots the picks can name where fewer than the bank's (a layer's
    experts in a bank of several layers' slots): `choose_tile` counts the picks an expert over
    them, and they bound the dots path's tiles; None: the bank's slots.
    """
    n, _, _ = bank_dims(bank)
    t, k = slot_ids.shape
    if demand is not None:
        check_demand(demand, t, k)
    named = reach(n, n_experts)
    tile = tile or choose_tile(bank_format(bank), t * k, named)
    form = (swiglu_limit, swiglu_alpha, swiglu_up_shift)  # tidejax.contract.swiglu's arguments
    if tile[0] == 1:
        per_pick, counters = _run_gemv(x, bank, slot_ids, demand, tile=tile, form=form,
                                       interpret=interpret)
    else:
        per_pick, counters = _run_dots(x, bank, slot_ids, demand, tile=tile, form=form,
                                       interpret=interpret, named=named)
    picked = per_pick.reshape(t, k, -1)
    picked = jnp.where((slot_ids >= 0)[:, :, None], picked, 0.0)  # rows never written: skip
    y = jnp.sum(weights.astype(jnp.float32)[:, :, None] * picked, axis=1).astype(x.dtype)
    return y if counters is None else (y, *counters)
