"""Paged GQA attention (decode and prefill) as one Triton kernel (tidejax.pallas.paged_gqa calls
it through jax-triton, or through Triton's interpreter off the GPU). Imported on use only: it
needs `triton`.

Program (sequence, KV head, query block x split) stacks BQ queries x the R query heads that
share one KV head as the rows of its dots (padded to M_P >= 16 rows, tl.dot's least width; a
decode step is BQ = 1: the R heads of its one query) and walks its split's share of the
BLOCK_N-key blocks up to the block's last query position (loaded, so one compile serves any
length), starting at the first block any of its rows can see (a sliding window's: so a long
context costs the window, not the sequence): each block's keys and values are gathered row by
row through the block table (a block may span pages or be part of one) and read once for all its
rows; a row sees the keys at positions <= its query's (and, with a window W, > its query's - W).
The window is a constexpr: its mask and loop start are compiled out for full attention, and a
model has few distinct windows (gpt-oss one), a compile each. Online softmax in float32 (running
max and sum); the split's unnormalized output, max and sum are written for a log-sum-exp combine
in jnp (where attention sinks join the denominator). Padding is a finite -3e38, never -inf.
"""

import triton
import triton.language as tl


# reductions through tl.reduce with combine functions of our own: tl.sum and tl.max are jitted
# library functions that Triton's interpreter cannot call unless the process started in its
# interpreter mode (TRITON_INTERPRET=1), which would take the GPU path from everything else
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _smaller(a, b):
    return tl.minimum(a, b)


@triton.jit
def paged_gqa_kernel(q_ptr, k_ptr, v_ptr, table_ptr, positions_ptr, n_table, scale, acc_ptr,
                     top_ptr, total_ptr, T: tl.constexpr, H: tl.constexpr, G: tl.constexpr,
                     R: tl.constexpr, BQ: tl.constexpr, M_P: tl.constexpr, DK: tl.constexpr,
                     DK_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr, PS: tl.constexpr,
                     BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, MIN_BLOCKS: tl.constexpr,
                     WINDOW: tl.constexpr, PRECISION: tl.constexpr, Q_TERMS: tl.constexpr,
                     DOT_F32: tl.constexpr):
    """q [b, T, H, DK]; k, v pools [n_pages, PS, G, DK | DV]; table [b, n_table] int32;
    positions [b, T] int32 -> acc [b, G, SPLITS, T, R, DV], top and total [b, G, SPLITS, T, R]
    (float32). The outputs come after the inputs and scalars: jax-triton binds the operands it
    is given to the first parameters and the outputs to the rest. WINDOW > 0: a row at position
    p sees only the keys at positions > p - WINDOW."""
    seq, kvh = tl.program_id(0), tl.program_id(1)
    qb, split = tl.program_id(2) // SPLITS, tl.program_id(2) % SPLITS
    m = tl.arange(0, M_P)  # dot rows: (query qb * BQ + m // R, head kvh * R + m % R)
    t = qb * BQ + m // R
    row_ok = (m < BQ * R) & (t < T)
    head = kvh * R + m % R
    dk = tl.arange(0, DK_P)[None, :]  # [1, DK_P]
    dv = tl.arange(0, DV_P)[None, :]
    n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    q = tl.load(q_ptr + ((seq * T + t[:, None]) * H + head[:, None]) * DK + dk,
                mask=row_ok[:, None] & (dk < DK), other=0.0)
    q = q.to(tl.float32) * scale  # [M_P, DK_P]; padded rows and channels 0
    pool = k_ptr.dtype.element_ty
    q_hi = q.to(pool)  # the query as dot operands of the pool's dtype: one term, or for a
    q_lo = (q - q_hi.to(tl.float32)).to(pool)  # float32 query over a bf16 pool, two
    if DOT_F32:  # Triton's interpreter: its bf16 dots come out wrong, so the operands, rounded
        q_hi = q_hi.to(tl.float32)  # to the pool's dtype as on the GPU, enter float32 dots
        q_lo = q_lo.to(tl.float32)  # (exact products: only the order of the sums differs)

    # each row sees positions 0..pos (none where pos < 0), the last WINDOW of them where WINDOW
    # > 0; the program reads from the first block any row's window reaches up to its last row's
    pos = tl.load(positions_ptr + seq * T + t, mask=row_ok, other=-1)  # [M_P]
    seen = tl.minimum(pos, n_table * PS - 1)  # a row's last key: the table's end at most
    length = tl.reduce(seen, 0, _larger) + 1
    n_blocks = (tl.maximum(length, 0) + BLOCK_N - 1) // BLOCK_N
    start = 0
    if WINDOW > 0:  # the lowest position of a row that sees any keys, less the window
        lowest = tl.reduce(tl.where(pos >= 0, pos, n_table * PS), 0, _smaller)
        start = tl.minimum(tl.maximum(lowest - WINDOW + 1, 0) // BLOCK_N, n_blocks)
    per_split = tl.maximum((n_blocks - start + SPLITS - 1) // SPLITS, MIN_BLOCKS)
    first = tl.minimum(start + split * per_split, n_blocks)
    last = tl.minimum(first + per_split, n_blocks)

    top = tl.full([M_P], -3.0e38, tl.float32)  # finite: a row with no keys keeps a 0 sum
    total = tl.full([M_P], 0.0, tl.float32)
    acc = tl.full([M_P, DV_P], 0.0, tl.float32)
    i = first
    while i < last:  # not range(first, last): Triton's interpreter cannot take bounds
        # that are tensors (its scalars are arrays of one element)
        key_pos = i * BLOCK_N + n  # [BLOCK_N]
        held = key_pos < length
        page = tl.load(table_ptr + seq * n_table + tl.minimum(key_pos // PS, n_table - 1))
        row = (page.to(tl.int64) * PS + key_pos % PS) * G + kvh  # [BLOCK_N] pool rows (64-bit)
        keys = tl.load(k_ptr + row[:, None] * DK + dk, mask=held[:, None] & (dk < DK),
                       other=0.0)  # [BLOCK_N, DK_P]
        values = tl.load(v_ptr + row[:, None] * DV + dv, mask=held[:, None] & (dv < DV),
                         other=0.0)  # [BLOCK_N, DV_P]
        if DOT_F32:
            keys = keys.to(tl.float32)
            values = values.to(tl.float32)
        kt = tl.trans(keys)
        s = tl.dot(q_hi, kt, input_precision=PRECISION)  # [M_P, BLOCK_N]
        if Q_TERMS == 2:
            s += tl.dot(q_lo, kt, input_precision=PRECISION)
        visible = key_pos[None, :] <= seen[:, None]  # [M_P, BLOCK_N]
        if WINDOW > 0:
            visible = visible & (key_pos[None, :] > pos[:, None] - WINDOW)
        s = tl.where(visible, s, -3.0e38)
        new_top = tl.maximum(top, tl.reduce(s, 1, _larger))
        keep = tl.exp(top - new_top)
        p = tl.where(visible, tl.exp(s - new_top[:, None]), 0.0)
        total = total * keep + tl.reduce(p, 1, _add)
        p_dot = p.to(pool)  # bf16 pools: rounded to bf16 for the value dot
        if DOT_F32:
            p_dot = p_dot.to(tl.float32)
        acc = acc * keep[:, None] + tl.dot(p_dot, values, input_precision=PRECISION)
        top = new_top
        i += 1

    # [b, G, SPLITS, T, R] rows: this program's (sequence, KV head, split), its queries and heads
    out = (((seq * G + kvh) * SPLITS + split) * T + t) * R + m % R  # [M_P]
    tl.store(acc_ptr + out[:, None] * DV + dv, acc, mask=row_ok[:, None] & (dv < DV))
    tl.store(top_ptr + out, top, mask=row_ok)
    tl.store(total_ptr + out, total, mask=row_ok)
