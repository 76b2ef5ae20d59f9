"""The paged GQA kernel (pallas.paged_gqa, Triton; its interpreter on the CPU), decode and a prompt
chunk, against the jnp reference and against float64 numpy: head groupings, page sizes, ragged
lengths (0, 1, mid-page, a full table), table padding, several key blocks and splits, queries
that see nothing, bf16 and float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tidejax import ops
from tidejax.pallas import paged_gqa as forms

BF16, F32 = jnp.bfloat16, jnp.float32


def paged_case(rng, h, g, ps, k=24, v=24, lengths=(1, 6, 0, 17), width=6, nan_padding=False):
    """Rows of `lengths` over shuffled pages of `ps`; the table `width` pages wide, its entries
    past each row's pages pointing at one spare page (NaN where `nan_padding`: read, it would
    reach the output) -> (q [b, h, k], k_pages, v_pages, table, lengths) as numpy float32."""
    b = len(lengths)
    held = [-(-n // ps) for n in lengths]
    n_pages = sum(held) + 2
    spare = n_pages - 1
    k_pages = rng.normal(0, 1, (n_pages, ps, g, k)).astype(np.float32)
    v_pages = rng.normal(0, 1, (n_pages, ps, g, v)).astype(np.float32)
    if nan_padding:
        k_pages[spare] = v_pages[spare] = np.nan
    order = rng.permutation(n_pages - 1)
    table = np.full((b, width), spare, np.int32)
    start = 0
    for row, n in enumerate(held):
        table[row, :n] = order[start:start + n]
        start += n
    q = rng.normal(0, 1, (b, h, k)).astype(np.float32)
    return q, k_pages, v_pages, table, np.asarray(lengths, np.int32)


def numpy_attention(q, k_pages, v_pages, table, positions, scale, sinks=None, window=0):
    """float64: q [b, t, h, k]; each query over its row's positions 0..its own through the
    table (zeros where negative); with `window` only the last `window` of them; `sinks` [h]: a
    logit per head in the denominator."""
    b, t, h, _ = q.shape
    _, ps, g, v = v_pages.shape
    out = np.zeros((b, t, h, v))
    for row in range(b):
        keys = k_pages[table[row]].reshape(-1, g, k_pages.shape[-1]).astype(np.float64)
        values = v_pages[table[row]].reshape(-1, g, v).astype(np.float64)
        for i in range(t):
            n = positions[row, i] + 1
            for head in range(h if n > 0 else 0):
                kv = head // (h // g)
                first = max(0, n - window) if window else 0
                scores = keys[first:n, kv] @ q[row, i, head].astype(np.float64) * scale
                top = scores.max() if sinks is None else max(scores.max(), sinks[head])
                p = np.exp(scores - top)
                sink = 0.0 if sinks is None else np.exp(sinks[head] - top)
                out[row, i, head] = p @ values[first:n, kv] / (p.sum() + sink)
    return out


def run_both(args, scale, q_dtype, pool_dtype):
    q, k_pages, v_pages, table, lengths = args
    device = (jnp.asarray(q, q_dtype), jnp.asarray(k_pages, pool_dtype),
              jnp.asarray(v_pages, pool_dtype), jnp.asarray(table), jnp.asarray(lengths))
    want = forms.paged_gqa_decode_reference(*device, scale=scale)
    got = jax.jit(lambda *a: ops.paged_gqa_decode(*a, scale=scale, impl="pallas"))(*device)
    assert got.shape == want.shape and got.dtype == jnp.float32
    return np.asarray(got), np.asarray(want)


@pytest.mark.parametrize("h,g,ps,q_dtype,pool_dtype", [
    (8, 2, 4, F32, F32),  # 4 query heads a KV head; pages of 4: a key block spans 16 pages
    (4, 4, 16, F32, F32),  # one query head a KV head (plain multi-head)
    (12, 1, 8, F32, F32),  # GLM-4.5's 12 a KV head (padded to 16 dot rows), one KV head
    (8, 2, 16, BF16, BF16),  # the served dtype: bf16 dots, probabilities rounded to bf16
    (4, 2, 8, F32, BF16),  # a float32 query over a bf16 pool: two bf16 terms
])
def test_the_kernel_computes_the_reference(rng, h, g, ps, q_dtype, pool_dtype):
    """Rows of lengths 1, mid-page, 0 and a whole 6-page table (table padding between); head dim
    24 (padded to 32 in the kernel)."""
    args = paged_case(rng, h, g, ps, lengths=(1, ps + ps // 2 + 1, 0, 6 * ps))
    got, want = run_both(args, 0.2, q_dtype, pool_dtype)
    tol = 1e-5 if pool_dtype == F32 else 2e-2  # bf16: ~2**-8 of the values' scale
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert not got[2].any()  # length 0: zeros


def test_several_blocks_and_splits_read_only_each_rows_pages(rng, monkeypatch):
    """Key blocks of 16 over pages of 4, a split a block: rows spanning 1 to 4 splits, one
    ending mid-block and mid-page; every table entry past a row's pages holds NaN (the spare
    page), which would reach the output if read. Against float64 numpy."""
    monkeypatch.setattr(forms, "BLOCK_N", 16)
    monkeypatch.setattr(forms, "MIN_BLOCKS_PER_SPLIT", 1)
    assert forms.choose_splits(3 * 2, 16, 4) == 4
    q, k_pages, v_pages, table, lengths = args = paged_case(
        rng, 6, 2, 4, k=16, v=32, lengths=(63, 5, 22), width=16, nan_padding=True)
    device = [jnp.asarray(a) for a in args]
    got = np.asarray(jax.jit(lambda *a: ops.paged_gqa_decode(*a, scale=0.25, impl="pallas"))(
        *device))
    want = numpy_attention(q[:, None], k_pages, v_pages, table, (lengths - 1)[:, None], 0.25)
    np.testing.assert_allclose(got, want[:, 0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("h,g,pool_dtype", [(4, 2, F32), (12, 1, F32), (4, 4, BF16)])
def test_a_prompt_chunk_sees_its_own_positions(rng, monkeypatch, h, g, pool_dtype):
    """Chunks of 7 queries over pages of 4 (key blocks of 16, a split a block): row 0's chunk
    starts mid-page at 11 (its last query sees 18 keys over two blocks), row 1's at 0 with two
    padding queries at position -1 (zeros); query blocks of 2 to 7 queries (ROWS 8: 8 // R).
    The kernel against the reference on finite pools, and against float64 numpy where every
    table entry past a row's pages holds NaN."""
    monkeypatch.setattr(forms, "BLOCK_N", 16)
    monkeypatch.setattr(forms, "MIN_BLOCKS_PER_SPLIT", 1)
    monkeypatch.setattr(forms, "ROWS", 8)
    positions = np.array([list(range(11, 18)), [0, 1, 2, 3, 4, -1, -1]], np.int32)
    for nan_padding in (False, True):
        q, k_pages, v_pages, table, _ = paged_case(rng, h, g, 4, lengths=(18, 5), width=8,
                                                   nan_padding=nan_padding)
        q = rng.normal(0, 1, (2, 7, h, 24)).astype(np.float32)
        device = (jnp.asarray(q, pool_dtype), jnp.asarray(k_pages, pool_dtype),
                  jnp.asarray(v_pages, pool_dtype), jnp.asarray(table), jnp.asarray(positions))
        got = np.asarray(jax.jit(lambda *a: ops.paged_gqa_prefill(
            *a, scale=0.2, impl="pallas"))(*device))
        assert not got[1, 5:].any()
        tol = 1e-5 if pool_dtype == F32 else 2e-2
        if nan_padding:
            q, k_pages, v_pages = (np.asarray(a, np.float32) for a in device[:3])  # as rounded
            want = numpy_attention(q, k_pages, v_pages, table, positions, 0.2)
        else:
            want = np.asarray(forms.paged_gqa_reference(*device, scale=0.2))
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_auto_takes_the_kernel_only_where_it_fits():
    """"auto" takes the kernel on a GPU, the reference elsewhere; the kernel takes bf16 and
    float32 heads up to MAX_HEAD_DIM channels and MAX_GROUP query heads a KV head (jax-triton
    installed)."""
    q, pool = jnp.zeros((2, 8, 128), BF16), jnp.zeros((4, 16, 2, 128), BF16)
    fits = forms.triton_supports(q, pool, pool)
    want = "pallas" if jax.default_backend() == "gpu" else "reference"
    assert ops.dispatch.choose_impl("paged_gqa_decode", "auto", lambda: fits) == want
    wide = jnp.zeros((4, 16, 2, 512), BF16)
    assert not forms.triton_supports(jnp.zeros((2, 8, 512), BF16), wide, wide)
    assert not forms.triton_supports(jnp.zeros((2, 256, 128), BF16), pool[:, :, :2], pool)
    assert not forms.triton_supports(q.astype(jnp.float16), pool, pool)


def poison_before_the_window(k_pages, v_pages, table, positions, window, block) -> list:
    """NaN in each row's pages that lie wholly before the key block holding its lowest query's
    first visible position (a loop that read them would carry NaN into the output) -> the rows
    that got some."""
    poisoned, ps = [], k_pages.shape[1]
    for row, pos in enumerate(positions):
        seen = pos[pos >= 0]
        pages = table[row, :max(0, seen.min() - window + 1) // block * block // ps] if (
            seen.size and window) else []
        if len(pages):
            k_pages[pages] = v_pages[pages] = np.nan
            poisoned.append(row)
    return poisoned


@pytest.mark.parametrize("window,with_sinks", [
    (3, True),  # shorter than a page (4)
    (10, False),  # longer than a page, shorter than a key block (16)
    (40, True),  # several key blocks
    (1000, True),  # longer than every context: all of it
    (0, True),  # sinks alone
])
def test_a_window_and_sinks_on_the_kernel(rng, monkeypatch, window, with_sinks):
    """gpt-oss's attention on the kernel, decode and a prompt chunk, against float64 numpy: a
    sink logit per head (or none) and a sliding window (or none). Key blocks of 16 over pages of
    4, a split a block (so splits > 1), query blocks of 4 (ROWS 8, R 2); rows of lengths 90, 21
    and 0 (decode) and chunks at 83..89 and 0..4 with two padding queries (prefill). Every table
    entry past a row's pages holds NaN, and so does every page before the block where the
    row's windows begin: the loop starts at the window's first block. The reference (key blocks
    of one page) against numpy too, on pools without NaN."""
    from tidejax.kv import paged
    monkeypatch.setattr(forms, "BLOCK_N", 16)
    monkeypatch.setattr(forms, "MIN_BLOCKS_PER_SPLIT", 1)
    monkeypatch.setattr(forms, "ROWS", 8)
    monkeypatch.setattr(paged, "KEY_BLOCK", 4)
    assert forms.choose_splits(3 * 2, 24, 4, window, 1) > 1
    h, g = 4, 2
    q, k_pages, v_pages, table, lengths = paged_case(rng, h, g, 4, lengths=(90, 21, 0),
                                                     width=24, nan_padding=True)
    sinks = rng.normal(0, 2, h).astype(np.float32) if with_sinks else None
    chunk = rng.normal(0, 1, (2, 7, h, 24)).astype(np.float32)
    positions = np.array([list(range(83, 90)), [0, 1, 2, 3, 4, -1, -1]], np.int32)
    # op -> (queries [b, t, h, k], the table's rows, positions [b, t], the op's last argument)
    cases = {"decode": (q[:, None], table, (lengths - 1)[:, None], lengths),
             "prefill": (chunk, table[:2], positions, positions)}
    for op, (queries, rows, at, last) in cases.items():
        clean = [np.nan_to_num(a) for a in (k_pages, v_pages)]
        poisoned = [a.copy() for a in (k_pages, v_pages)]
        assert bool(poison_before_the_window(*poisoned, rows, at, window, 16)) == (
            0 < window < 83)  # the long row's early pages, at least
        want = numpy_attention(queries, *clean, rows, at, 0.2, sinks, window)
        for impl, pools in (("pallas", poisoned), ("reference", clean)):
            got = getattr(ops, f"paged_gqa_{op}")(
                jnp.asarray(queries[:, 0] if op == "decode" else queries),
                *map(jnp.asarray, (*pools, rows, last)), scale=0.2,
                sinks=None if sinks is None else jnp.asarray(sinks), window=window, impl=impl)
            got = np.asarray(got).reshape(want.shape)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{op} {impl}")


def test_bad_sinks_and_windows_are_named():
    q, pool = jnp.zeros((2, 4, 16)), jnp.zeros((4, 4, 2, 16))
    table, lengths = jnp.zeros((2, 4), jnp.int32), jnp.ones((2,), jnp.int32)
    for impl in ("pallas", "reference"):
        with pytest.raises(ValueError, match="sinks .* must be"):
            ops.paged_gqa_decode(q, pool, pool, table, lengths, scale=1.0, sinks=jnp.zeros(2),
                                 impl=impl)
        with pytest.raises(ValueError, match="window -1 must be"):
            ops.paged_gqa_decode(q, pool, pool, table, lengths, scale=1.0, window=-1, impl=impl)
