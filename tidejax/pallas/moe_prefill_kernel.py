"""The grouped MoE of a prompt chunk as one Triton grouped GEMM, run twice (tidejax.pallas.
moe_prefill calls it through jax-triton, or through Triton's interpreter off the GPU). Imported on
use only: it needs `triton`.

The picks are sorted by slot into tiles of BM rows, each tile one expert (moe_plan.plan_tiles).
Program (N block, tile) multiplies BN weight rows of the tile's expert by its tile's BM
activation rows (a transposed tile [BN, BM]: the weights are the dot's first operand, which
Hopper's wgmma reads from registers), looping over K in BK steps: a bf16 tl.dot a step, float32
accumulation. bf16 weights are read as they are; MXFP4 ones ({*_blocks, *_scales}) are decoded
in registers: each byte's two e2m1 codes become bf16 values times the block's power-of-two scale
(exact), the low nibbles the even inputs and the high nibbles the odd ones, so each activation
row is stored de-interleaved (its even columns, then its odd ones) and a step is two dots of
BK / 2, never an interleave.

GATE_UP (the first pass): the activations are the tokens' rows of x, gathered through the plan;
the program accumulates the gate rows [n0, n0 + BN) and the up rows I + [n0, n0 + BN) (a K step's
activations loaded once for both), adds the
bias (BIAS), and writes swiglu(g, u) (tidejax.contract: g <= LIMIT, |u| <= LIMIT when LIMIT > 0,
g * sigmoid(ALPHA g) * (u + UP_SHIFT)) as bf16 h [rows, I], de-interleaved as above when the next
pass reads MXFP4. The second pass: the activations are h's rows; the program adds the down bias
(BIAS) and writes each row's output times its pick's weight (0 on padding rows), float32.
"""

import triton
import triton.language as tl


@triton.jit
def moe_prefill_kernel(a_ptr, tile_slot_ptr, row_token_ptr, row_weight_ptr, w_ptr, scale_ptr,
                       bias_ptr, out_ptr, K: tl.constexpr, R: tl.constexpr, N: tl.constexpr,
                       PHASES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, GATE_UP: tl.constexpr, BIAS: tl.constexpr,
                       LIMIT: tl.constexpr, ALPHA: tl.constexpr, UP_SHIFT: tl.constexpr,
                       DOT_F32: tl.constexpr):
    """a [rows of x (GATE_UP) or of h, K] bf16, each row de-interleaved into PHASES planes of
    K / PHASES; tile_slot [n_tiles] int32 (-1: unused); row_token [n_tiles * BM] int32 (GATE_UP:
    the x row of each tile row); row_weight [n_tiles * BM] float32 (the second pass: its pick's
    weight); the projection w: bf16 [slots, R, K] (PHASES 1; scale_ptr unused) or MXFP4 bytes
    [slots, R, K / 2] and e8m0 scales [slots, R, K / 32] (PHASES 2); bias [slots, R] (BIAS);
    -> out: GATE_UP h [n_tiles * BM, N] bf16 (N = R / 2 = I), else [n_tiles * BM, N] float32
    (N = R = D). The outputs come after the inputs: jax-triton binds the operands it is given
    to the first parameters and the outputs to the rest. DOT_F32: Triton's interpreter, whose
    bf16 dots are wrong, gets float32 dots of the same bf16 operands (exact products)."""
    col, tile = tl.program_id(0), tl.program_id(1)
    slot = tl.load(tile_slot_ptr + tile)
    if slot >= 0:
        m = tile * BM + tl.arange(0, BM)  # [BM] the tile's rows
        if GATE_UP:
            src = tl.load(row_token_ptr + m)  # [BM] their tokens' rows of x
        else:
            src = m
        KP: tl.constexpr = BK // PHASES  # a phase's values a K step
        j = tl.arange(0, KP)  # [KP]
        n = col * BN + tl.arange(0, BN)  # [BN] output columns (GATE_UP: the gate's weight rows)
        a_rows = a_ptr + src.to(tl.int64)[:, None] * K  # [BM, 1]
        w_first = slot.to(tl.int64) * R  # the slot's first weight row
        acc = tl.full((BN, BM), 0.0, tl.float32)
        up = tl.full((BN, BM), 0.0, tl.float32)  # GATE_UP: the up rows', N further down
        for kk in range(0, K // BK):
            # the activations' phases a step [KP, BM], loaded once for the gate's and up's dots
            a0 = tl.trans(tl.load(a_rows + kk * KP + j[None, :]))
            if PHASES == 2:
                a1 = tl.trans(tl.load(a_rows + K // 2 + kk * KP + j[None, :]))
            for half in tl.static_range(2 if GATE_UP else 1):  # the gate's rows, the up's
                rows = w_first + n + half * N  # [BN] weight rows, 64-bit
                if PHASES == 2:  # MXFP4: a step's bytes and their blocks' scales, read once
                    at = rows[:, None] * (K // 2) + kk * KP + j[None, :]  # [BN, KP] bytes
                    packed = tl.load(w_ptr + at)
                    e = tl.load(scale_ptr + at // 16)  # a block's 16 bytes share its scale
                    # 2**(e - 127 + 14) as float32 bits; e <= 240: no real weight is larger
                    e = tl.minimum(e.to(tl.int32), 240)
                    scale = ((e + 14) << 23).to(tl.float32, bitcast=True)
                for p in tl.static_range(PHASES):
                    a = a0 if p == 0 else a1
                    if PHASES == 1:  # bf16 [BN, BK]
                        w = tl.load(w_ptr + rows[:, None] * K + kk * BK + j[None, :])
                    else:  # phase p: the bytes' low (0) or high (1) nibbles
                        code = (packed >> (4 * p)) & 15
                        # the code's exponent and mantissa bits at the bottom of an fp16's
                        # exponent and top of its mantissa, its sign on the sign: the e2m1
                        # value * 2**-14, exact (0 and +-0.5 as fp16 subnormals)
                        bits = ((code & 7).to(tl.uint16) << 9) | ((code & 8).to(tl.uint16) << 12)
                        w = bits.to(tl.float16, bitcast=True).to(tl.float32) * scale
                        w = w.to(tl.bfloat16)
                    if DOT_F32:
                        part = tl.dot(w.to(tl.float32), a.to(tl.float32),
                                      input_precision="ieee")
                    else:
                        part = tl.dot(w, a)  # [BN, BM]
                    if half == 0:
                        acc += part
                    else:
                        up += part
        if BIAS:
            acc += tl.load(bias_ptr + w_first + n).to(tl.float32)[:, None]
            if GATE_UP:
                up += tl.load(bias_ptr + w_first + N + n).to(tl.float32)[:, None]
        if GATE_UP:  # h = swiglu(g, u), as bf16: the down pass's dot operand
            g = acc
            if LIMIT > 0:
                g = tl.minimum(g, LIMIT)
                up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
            h = g / (1.0 + tl.exp(-ALPHA * g)) * (up + UP_SHIFT)
            # column c of h at plane c % PHASES, place c // PHASES of its row
            at = (n % PHASES) * (N // PHASES) + n // PHASES
            tl.store(out_ptr + m.to(tl.int64)[None, :] * N + at[:, None], h.to(tl.bfloat16))
        else:
            weight = tl.load(row_weight_ptr + m)  # [BM]
            tl.store(out_ptr + m.to(tl.int64)[None, :] * N + n[:, None], acc * weight[None, :])
