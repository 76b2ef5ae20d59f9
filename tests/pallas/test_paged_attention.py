"""Paged MLA attention, decode (one query a row) and prefill (a prompt chunk's queries): the jnp
references against dense float64 numpy, the Pallas kernels (interpret mode on CPU) against the
references and float64, the dispatch, and the Triton lowering at DeepSeek-V3 shapes.

Random inputs come from a seed that each test prints; TIDEJAX_TEST_SEED replays one."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tidejax.ops import paged_mla_decode, paged_mla_prefill
from tidejax.pallas.attention import (choose_splits, paged_mla_decode_pallas,
                                      paged_mla_decode_reference, paged_mla_prefill_pallas,
                                      paged_mla_prefill_reference, pallas_supports)

SCALE = 0.3




def shuffled_table(rng, held, n_table, spare_pages):
    """A pool of sum(held) + spare_pages pages handed out shuffled: row i's first held[i] table
    entries are its own pages, the rest random (valid) page ids -> (table [rows, n_table],
    n_pages)."""
    n_pages = sum(held) + spare_pages
    order = rng.permutation(n_pages)
    table = rng.integers(0, n_pages, (len(held), n_table)).astype(np.int32)
    used = 0
    for i, k in enumerate(held):
        table[i, :k] = order[used:used + k]
        used += k
    return table, n_pages


def make_case(rng, *, b, h, c, r, ps, n_table, lengths, pool_dtype, q_dtype, spare_pages=5):
    """Random queries and a pool whose pages are handed out shuffled; table entries past a
    sequence's pages hold random (valid) page ids. -> (args, pool as float64 numpy)."""
    table, n_pages = shuffled_table(rng, [-(-length // ps) for length in lengths], n_table,
                                    spare_pages)
    latent = jnp.asarray(rng.standard_normal((n_pages, ps, c)), pool_dtype)
    rope = jnp.asarray(rng.standard_normal((n_pages, ps, r)), pool_dtype)
    q = jnp.asarray(rng.standard_normal((b, h, c)) / np.sqrt(c), q_dtype)
    qr = jnp.asarray(rng.standard_normal((b, h, r)) / np.sqrt(r), q_dtype)
    args = (q, qr, latent, rope, jnp.asarray(table), jnp.asarray(lengths, jnp.int32))
    return args, tuple(np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in args[:4])


def numpy_attention(q, qr, latent, rope, table, lengths, scale):
    """Float64, one sequence at a time: its visible positions gathered row by row, then a dense
    softmax over them."""
    b, h, c = q.shape
    ps = latent.shape[1]
    out = np.zeros((b, h, c))
    for i in range(b):
        pos = np.arange(lengths[i])
        keys = latent[table[i, pos // ps], pos % ps]  # [length, c]
        rope_keys = rope[table[i, pos // ps], pos % ps]
        if len(pos) == 0:
            continue
        s = (q[i] @ keys.T + qr[i] @ rope_keys.T) * scale  # [h, length]
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[i] = (p / p.sum(axis=1, keepdims=True)) @ keys
    return out


def rel_err(got, want):
    return np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()


# Lengths over a table of 6 pages: empty, one position, a partial first page, a partial last
# page, exactly full pages, the full table.
def lengths_for(ps, n_table=6):
    return [0, 1, ps - 1, 2 * ps + 1, 3 * ps, n_table * ps]


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("ps", [4, 8])
def test_reference_matches_float64(rng, pool_dtype, ps):
    lengths = lengths_for(ps)
    args, pool64 = make_case(rng, b=len(lengths), h=4, c=32, r=16, ps=ps, n_table=6, lengths=lengths,
                             pool_dtype=pool_dtype, q_dtype=jnp.float32)
    want = numpy_attention(*pool64, np.asarray(args[4]), lengths, SCALE)
    got = jax.jit(paged_mla_decode_reference, static_argnames="scale")(*args, scale=SCALE)
    assert got.dtype == jnp.float32 and got.shape == (len(lengths), 4, 32)
    assert rel_err(got, want) < 1e-5
    np.testing.assert_array_equal(np.asarray(got[0]), 0.0)  # length 0 -> zeros


def test_reference_reads_only_the_table_pages():
    """Its buffers follow the table, not the pool: a pool 4,096x larger adds no temporary bytes
    (XLA's cost_analysis would count a convert it fuses into the gather over the whole pool, though
    only the gathered rows are computed)."""
    shape = jax.ShapeDtypeStruct
    q, qr = shape((2, 4, 32), jnp.float32), shape((2, 4, 16), jnp.float32)
    table, lengths = shape((2, 6), jnp.int32), shape((2,), jnp.int32)
    temp = []
    for n_pages in (16, 65536):
        pool = shape((n_pages, 8, 32), jnp.bfloat16), shape((n_pages, 8, 16), jnp.bfloat16)
        compiled = jax.jit(paged_mla_decode_reference, static_argnames="scale").lower(
            q, qr, *pool, table, lengths, scale=SCALE).compile()
        temp.append(compiled.memory_analysis().temp_size_in_bytes)
    assert temp[0] == temp[1] < 2 * 48 * 48 * 4 * 4  # a few [b, P * page_size, c] float32 buffers


# (pool dtype, query dtype, tolerance against the float32 reference): float32 pools run float32
# dots; bf16 pools bf16 dots (float32 queries as two bf16 terms, probabilities rounded to bf16).
DTYPES = [(jnp.float32, jnp.float32, 1e-5), (jnp.bfloat16, jnp.float32, 5e-3),
          (jnp.bfloat16, jnp.bfloat16, 5e-3)]


@pytest.mark.parametrize("pool_dtype,q_dtype,tol", DTYPES)
@pytest.mark.parametrize("ps", [4, 8])
def test_kernel_interpret_matches_reference(rng, pool_dtype, q_dtype, tol, ps):
    lengths = lengths_for(ps)
    args, _ = make_case(rng, b=len(lengths), h=4, c=32, r=16, ps=ps, n_table=6, lengths=lengths,
                        pool_dtype=pool_dtype, q_dtype=q_dtype)
    want = np.asarray(paged_mla_decode_reference(*args, scale=SCALE), np.float64)
    got = paged_mla_decode_pallas(*args, scale=SCALE, interpret=True)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    assert rel_err(got, want) < tol
    np.testing.assert_array_equal(np.asarray(got[0]), 0.0)


@pytest.mark.parametrize("pool_dtype,q_dtype,tol,ps,n_table", [(*DTYPES[0], 8, 24), (*DTYPES[1], 32, 6)])
def test_kernel_splits_and_head_blocks(rng, pool_dtype, q_dtype, tol, ps, n_table):
    """Several head blocks (20 heads: two blocks of 16, padded) and sequences split across
    programs (partials combined), some splits empty; chunks of 16 positions: two pages gathered
    row by row (pages of 8), or half a page read as one block (pages of 32)."""
    lengths = [0, 5, 8 * 16 + 3, n_table * ps]
    args, _ = make_case(rng, b=len(lengths), h=20, c=32, r=16, ps=ps, n_table=n_table, lengths=lengths,
                        pool_dtype=pool_dtype, q_dtype=q_dtype)
    want = np.asarray(paged_mla_decode_reference(*args, scale=SCALE), np.float64)
    assert choose_splits(len(lengths), 2, n_table * ps // 16) == 3  # the kernel's own choice: 3 splits
    for splits in (None, 5):  # (one split: the tests above)
        got = paged_mla_decode_pallas(*args, scale=SCALE, interpret=True, splits=splits,
                                      tile=(16, 16, 4, 1))
        assert rel_err(got, want) < tol, splits
        np.testing.assert_array_equal(np.asarray(got[0]), 0.0)


def _has_pallas_call(fn, *args):
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def test_dispatch_runs_the_kernel_when_asked(rng):
    """impl="pallas" runs the kernel (interpret mode on CPU); "auto" runs the reference here."""
    lengths = lengths_for(4)
    args, _ = make_case(rng, b=len(lengths), h=4, c=32, r=16, ps=4, n_table=6, lengths=lengths,
                        pool_dtype=jnp.bfloat16, q_dtype=jnp.bfloat16)
    run = lambda impl: (lambda *a: paged_mla_decode(*a, scale=SCALE, impl=impl))
    assert _has_pallas_call(run("pallas"), *args)
    assert not _has_pallas_call(run("reference"), *args)
    assert _has_pallas_call(run("auto"), *args) == (jax.default_backend() == "gpu")
    want = paged_mla_decode_pallas(*args, scale=SCALE, interpret=jax.default_backend() != "gpu")
    np.testing.assert_array_equal(np.asarray(jax.jit(run("pallas"))(*args)), np.asarray(want))
    assert rel_err(run("reference")(*args), np.asarray(paged_mla_decode_reference(*args, scale=SCALE))) == 0


def test_shapes_the_kernel_does_not_take():
    shape = jax.ShapeDtypeStruct
    q, qr = shape((2, 4, 32), jnp.float32), shape((2, 4, 16), jnp.float32)
    assert pallas_supports(q, qr, shape((8, 4, 32), jnp.bfloat16))
    assert not pallas_supports(shape((2, 4, 48), jnp.float32), qr, shape((8, 4, 48), jnp.bfloat16))  # c
    assert not pallas_supports(q, shape((2, 4, 8), jnp.float32), shape((8, 4, 32), jnp.bfloat16))  # r < 16
    assert not pallas_supports(q, qr, shape((8, 6, 32), jnp.bfloat16))  # page size
    assert not pallas_supports(q, qr, shape((8, 4, 32), jnp.float16))
    args = (np.zeros((1, 4, 48), np.float32), np.zeros((1, 4, 16), np.float32),
            np.zeros((3, 4, 48), np.float32), np.zeros((3, 4, 16), np.float32),
            np.zeros((1, 2), np.int32), np.ones(1, np.int32))
    with pytest.raises(ValueError, match="shapes the kernel does not take"):
        paged_mla_decode(*args, scale=SCALE, impl="pallas")
    assert paged_mla_decode(*args, scale=SCALE).shape == (1, 4, 48)  # auto: the reference


def test_mismatched_shapes_are_named():
    q, qr = np.zeros((2, 4, 32), np.float32), np.zeros((2, 4, 16), np.float32)
    latent, rope = np.zeros((3, 4, 32), np.float32), np.zeros((3, 4, 16), np.float32)
    table, lengths = np.zeros((2, 2), np.int32), np.ones(2, np.int32)
    with pytest.raises(ValueError, match=r"rope_pages has shape \(3, 4, 8\)"):
        paged_mla_decode(q, qr, latent, rope[..., :8], table, lengths, scale=SCALE)
    with pytest.raises(ValueError, match="block_table has shape"):
        paged_mla_decode(q, qr, latent, rope, table[:1], lengths, scale=SCALE)
    with pytest.raises(ValueError, match="lengths has shape"):
        paged_mla_decode(q, qr, latent, rope, table, lengths[:1], scale=SCALE)


@pytest.mark.parametrize("b,pool_dtype,q_dtype,tile", [(1, jnp.bfloat16, jnp.bfloat16, None),
                                                      (4, jnp.bfloat16, jnp.float32, (16, 128, 4, 2)),
                                                      (64, jnp.float32, jnp.float32, (16, 32, 4, 2))])
def test_kernel_lowers_to_triton_for_cuda(b, pool_dtype, q_dtype, tile):
    """The Pallas -> Triton lowering runs on a CPU machine too: DeepSeek-V3 shapes (h 128, c 512,
    r 64, pages of 64, a table of 4,096 pages); chunks of a page, two pages, half a page."""
    from jax import export

    shape = jax.ShapeDtypeStruct
    h, c, r, ps, n_table, n_pages = 128, 512, 64, 64, 4096, 8192
    kernel = jax.jit(lambda *a: paged_mla_decode_pallas(*a, scale=SCALE, tile=tile))
    exported = export.export(kernel, platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        shape((b, h, c), q_dtype), shape((b, h, r), q_dtype), shape((n_pages, ps, c), pool_dtype),
        shape((n_pages, ps, r), pool_dtype), shape((b, n_table), jnp.int32), shape((b,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


# ---- prefill: a prompt chunk's queries ------------------------------------------------------------

def make_chunk_case(rng, *, h, c, r, ps, n_table, starts, t, pool_dtype, q_dtype, spare_pages=5):
    """Rows of a chunk of t queries at positions starts[i].. over a pool whose pages are handed
    out shuffled (each row holds its n_table pages, out of order) -> (args, as float64 numpy)."""
    b = len(starts)
    n_pages = b * n_table + spare_pages
    table = rng.permutation(n_pages)[:b * n_table].reshape(b, n_table).astype(np.int32)
    latent = jnp.asarray(rng.standard_normal((n_pages, ps, c)), pool_dtype)
    rope = jnp.asarray(rng.standard_normal((n_pages, ps, r)), pool_dtype)
    q = jnp.asarray(rng.standard_normal((b, t, h, c)) / np.sqrt(c), q_dtype)
    qr = jnp.asarray(rng.standard_normal((b, t, h, r)) / np.sqrt(r), q_dtype)
    positions = np.asarray(starts, np.int32)[:, None] + np.arange(t, dtype=np.int32)[None]
    args = (q, qr, latent, rope, jnp.asarray(table), jnp.asarray(positions))
    return args, tuple(np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in args[:4])


def numpy_causal_attention(q, qr, latent, rope, table, positions, scale):
    """Float64, one query at a time: the positions 0..its own (all of the table past it) gathered
    row by row, then a dense softmax over them."""
    b, t, h, c = q.shape
    ps = latent.shape[1]
    out = np.zeros((b, t, h, c))
    for i in range(b):
        for j in range(t):
            pos = np.arange(min(positions[i, j], table.shape[1] * ps - 1) + 1)
            keys, rope_keys = latent[table[i, pos // ps], pos % ps], rope[table[i, pos // ps], pos % ps]
            s = (q[i, j] @ keys.T + qr[i, j] @ rope_keys.T) * scale  # [h, keys]
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[i, j] = (p / p.sum(axis=1, keepdims=True)) @ keys
    return out


# Rows over a table of 6 pages, a chunk of 10 queries: from 0, mid-row across a page boundary,
# ending two pages before the table's last one, and running past the table (a chunk's padding).
def starts_for(ps, n_table=6):
    return [0, ps + ps // 2, (n_table - 3) * ps - 10, n_table * ps - 4]


# (pool dtype, query dtype, tolerance against float64: the pool's values are exact there; bf16
# queries are rounded first, so the float64 reference gets the same rounded queries)
PREFILL_DTYPES = [(jnp.float32, jnp.float32, 1e-5), (jnp.bfloat16, jnp.float32, 1e-2),
                  (jnp.bfloat16, jnp.bfloat16, 1e-2)]


@pytest.mark.parametrize("pool_dtype,q_dtype,tol", PREFILL_DTYPES)
def test_prefill_reference_matches_float64(rng, pool_dtype, q_dtype, tol):
    """Key blocks of KEY_BLOCK (512) over pages of 64: two blocks, the second one partly past the
    table (padded)."""
    ps, n_table = 64, 12
    starts = [0, 300, 700]
    args, f64 = make_chunk_case(rng, h=2, c=16, r=16, ps=ps, n_table=n_table, starts=starts, t=20,
                                pool_dtype=pool_dtype, q_dtype=q_dtype)
    want = numpy_causal_attention(*f64, np.asarray(args[4]), np.asarray(args[5]), SCALE)
    got = jax.jit(paged_mla_prefill_reference, static_argnames="scale")(*args, scale=SCALE)
    assert got.dtype == q_dtype and got.shape == want.shape
    assert rel_err(got, want) < tol


# tiles (bq, bh, bk, warps, stages): key blocks of half a page, a page, two pages (rows gathered);
# fewer heads than bh (more queries a program), heads padded to a multiple of bh
PREFILL_CASES = [((4, 16, 4, 4, 1), 8, 4), ((2, 4, 8, 4, 1), 8, 4), ((2, 2, 16, 4, 1), 8, 3)]


@pytest.mark.parametrize("pool_dtype,q_dtype,tol", PREFILL_DTYPES)
@pytest.mark.parametrize("tile,ps,h", PREFILL_CASES)
def test_prefill_kernel_interpret_matches_reference_and_float64(rng, pool_dtype, q_dtype, tol, tile, ps, h):
    starts = starts_for(ps)
    args, f64 = make_chunk_case(rng, h=h, c=32, r=16, ps=ps, n_table=6, starts=starts, t=10,
                                pool_dtype=pool_dtype, q_dtype=q_dtype)
    want64 = numpy_causal_attention(*f64, np.asarray(args[4]), np.asarray(args[5]), SCALE)
    want = np.asarray(jnp.asarray(paged_mla_prefill_reference(*args, scale=SCALE), jnp.float32), np.float64)
    got = paged_mla_prefill_pallas(*args, scale=SCALE, interpret=True, tile=tile)
    assert got.dtype == q_dtype and got.shape == want.shape
    assert rel_err(got, want) < tol and rel_err(got, want64) < tol


def test_prefill_kernel_rows_that_see_nothing_are_zero(rng):
    args, _ = make_chunk_case(rng, h=4, c=32, r=16, ps=4, n_table=6, starts=[-10, 3], t=4,
                              pool_dtype=jnp.float32, q_dtype=jnp.float32)
    got = paged_mla_prefill_pallas(*args, scale=SCALE, interpret=True, tile=(4, 4, 4, 4, 1))
    want = paged_mla_prefill_reference(*args, scale=SCALE)
    np.testing.assert_array_equal(np.asarray(got[0]), 0.0)  # positions -10..-7
    np.testing.assert_array_equal(np.asarray(want[0]), 0.0)
    assert rel_err(got[1], np.asarray(want[1], np.float64)) < 1e-5


def test_prefill_dispatch_and_shapes(rng):
    """impl="pallas" runs the kernel (interpret mode on CPU), "reference" the jnp path, "auto" the
    kernel only on a GPU; shapes the kernel does not take fall back under "auto"; bad shapes and
    tiles are named."""
    args, _ = make_chunk_case(rng, h=4, c=32, r=16, ps=4, n_table=6, starts=[0, 5], t=3,
                              pool_dtype=jnp.bfloat16, q_dtype=jnp.bfloat16)
    run = lambda impl: (lambda *a: paged_mla_prefill(*a, scale=SCALE, impl=impl))
    assert _has_pallas_call(run("pallas"), *args)
    assert not _has_pallas_call(run("reference"), *args)
    assert _has_pallas_call(run("auto"), *args) == (jax.default_backend() == "gpu")
    odd = (np.zeros((1, 2, 4, 48), np.float32), np.zeros((1, 2, 4, 16), np.float32),
           np.zeros((3, 4, 48), np.float32), np.zeros((3, 4, 16), np.float32),
           np.zeros((1, 2), np.int32), np.ones((1, 2), np.int32))
    with pytest.raises(ValueError, match="shapes the kernel does not take"):
        paged_mla_prefill(*odd, scale=SCALE, impl="pallas")
    assert paged_mla_prefill(*odd, scale=SCALE).shape == (1, 2, 4, 48)  # auto: the reference
    with pytest.raises(ValueError, match=r"positions has shape \(2, 2\), expected \(2, 3\)"):
        paged_mla_prefill(*args[:5], args[5][:, :2], scale=SCALE)
    with pytest.raises(ValueError, match="powers of two"):
        paged_mla_prefill_pallas(*args, scale=SCALE, interpret=True, tile=(3, 4, 4, 4, 1))


@pytest.mark.parametrize("t,pool_dtype,q_dtype,tile", [(2048, jnp.bfloat16, jnp.bfloat16, None),
                                                      (48, jnp.bfloat16, jnp.float32, (1, 32, 128, 4, 2)),
                                                      (16, jnp.float32, jnp.float32, (2, 16, 32, 4, 2))])
def test_prefill_kernel_lowers_to_triton_for_cuda(t, pool_dtype, q_dtype, tile):
    """The lowering at DeepSeek-V3 shapes (h 128, c 512, r 64, pages of 64, a table of 128 pages):
    key blocks of a page, two pages, half a page."""
    from jax import export

    shape = jax.ShapeDtypeStruct
    h, c, r, ps, n_table, n_pages = 128, 512, 64, 64, 128, 512
    kernel = jax.jit(lambda *a: paged_mla_prefill_pallas(*a, scale=SCALE, tile=tile))
    exported = export.export(kernel, platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        shape((1, t, h, c), q_dtype), shape((1, t, h, r), q_dtype), shape((n_pages, ps, c), pool_dtype),
        shape((n_pages, ps, r), pool_dtype), shape((1, n_table), jnp.int32), shape((1, t), jnp.int32))
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


# ---- the lightning indexer's scores over paged keys (DeepSeek-V4.1) -----------------------------

from tidejax.kv import paged  # noqa: E402
from tidejax.ops import paged_index_scores  # noqa: E402
from tidejax.pallas.index_scores import paged_index_scores_pallas  # noqa: E402
from tidejax.pallas.index_scores import paged_index_scores_reference  # noqa: E402
from tidejax.pallas.index_scores import pallas_supports as index_supports  # noqa: E402


def make_index_case(rng, *, counts, heads, k, rows, n_table, pool_dtype, q_dtype, spare_pages=3):
    """Rows holding the pages their largest count needs (shuffled page ids; the rest of each
    table random valid pages), queries [b, t] -> (args, as float64 numpy)."""
    counts = np.asarray(counts, np.int32)
    b, t = counts.shape
    table, n_pages = shuffled_table(rng, [-(-int(c.max()) // rows) for c in counts], n_table,
                                    spare_pages)
    keys = jnp.asarray(rng.standard_normal((n_pages, rows, k)), pool_dtype)
    q = jnp.asarray(rng.standard_normal((b, t, heads, k)), q_dtype)
    w = jnp.asarray(rng.standard_normal((b, t, heads)), jnp.float32)
    args = (q, w, keys, jnp.asarray(table), jnp.asarray(counts))
    return args, tuple(np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in args[:3])


def numpy_index_scores(q, w, keys, table, counts, scale):
    """Float64, one query at a time: its visible entries gathered row by row."""
    b, t = counts.shape
    rows = keys.shape[1]
    out = np.full((b, t, table.shape[1] * rows), -np.inf)
    for i in range(b):
        for j in range(t):
            g = np.arange(counts[i, j])
            k = keys[table[i, g // rows], g % rows]  # [count, k]
            out[i, j, g] = (w[i, j] @ np.maximum(q[i, j] @ k.T, 0.0)) * scale
    return out


def check_scores(got, want, tol):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape and got.dtype == np.float64
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))  # -inf exactly past counts
    live = np.isfinite(want)
    assert np.abs(got[live] - want[live]).max() <= tol * np.abs(want[live]).max()


# Decode rows over a table of 6 pages of `rows` entries: none, one entry, a partial page, whole
# pages, the full table; and two queries a row of different counts (a chunk).
def index_counts(rows, n_table=6):
    return [[0], [1], [rows + 3], [3 * rows], [n_table * rows]]


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.bfloat16])
def test_index_scores_reference_matches_float64(rng, pool_dtype):
    rows = 8
    for counts in ([[6 * rows - 1, 6 * rows], [rows, 2 * rows + 1], [0, 5]], index_counts(rows)):
        args, f64 = make_index_case(rng, counts=counts, heads=3, k=32, rows=rows, n_table=6,
                                    pool_dtype=pool_dtype, q_dtype=jnp.float32)
        want = numpy_index_scores(*f64, np.asarray(args[3]), np.asarray(args[4]), SCALE)
        got = jax.jit(paged_index_scores_reference, static_argnames="scale")(*args, scale=SCALE)
        assert got.dtype == jnp.float32
        check_scores(got, want, 1e-6)
    assert np.isneginf(np.asarray(got[0, 0])).all()  # a query that sees nothing


# (pool dtype, query dtype, tolerance): float32 dots; bf16 dots (float32 queries as two terms)
INDEX_DTYPES = [(jnp.float32, jnp.float32, 1e-5), (jnp.bfloat16, jnp.float32, 1e-4),
                (jnp.bfloat16, jnp.bfloat16, 1e-5)]


@pytest.mark.parametrize("pool_dtype,q_dtype,tol", INDEX_DTYPES)
@pytest.mark.parametrize("rows,tile,heads", [(8, (16, 4, 1), 3), (32, (16, 4, 1), 20),
                                             (16, None, 8)])
def test_index_scores_kernel_interpret_matches_reference(rng, pool_dtype, q_dtype, tol, rows, tile,
                                                         heads):
    """Blocks of two small pages gathered row by row (rows 8, bk 16), half a page (rows 32), the
    default tile over pages of 16 (blocks of 64: past the table's end, padded); fewer heads than
    a dot's 16 rows and more (padded to 32); rows of length 0 all -inf."""
    args, f64 = make_index_case(rng, counts=index_counts(rows), heads=heads, k=32, rows=rows,
                                n_table=6, pool_dtype=pool_dtype, q_dtype=q_dtype)
    want = np.asarray(paged_index_scores_reference(*args, scale=SCALE), np.float64)
    got = paged_index_scores_pallas(*args, scale=SCALE, interpret=True, tile=tile)
    assert got.dtype == jnp.float32
    check_scores(got, want, tol)
    assert np.isneginf(np.asarray(got[0])).all()
    if pool_dtype == jnp.float32:
        check_scores(got, numpy_index_scores(*f64, np.asarray(args[3]), np.asarray(args[4]),
                                             SCALE), tol)


def test_index_scores_kernel_takes_a_chunk(rng):
    """impl="pallas" runs a prompt chunk's queries too (each with its own count)."""
    args, _ = make_index_case(rng, counts=[[0, 3, 9], [8, 16, 17]], heads=4, k=16, rows=8,
                              n_table=3, pool_dtype=jnp.float32, q_dtype=jnp.float32)
    want = np.asarray(paged_index_scores_reference(*args, scale=SCALE), np.float64)
    check_scores(paged_index_scores_pallas(*args, scale=SCALE, interpret=True, tile=(16, 4, 1)),
                 want, 1e-5)


def test_index_scores_dispatch_and_shapes(rng):
    """"pallas" runs the kernel, "reference" the jnp path; "auto" the kernel only on a GPU and
    only for decode (t = 1); shapes it does not take fall back under "auto", are named under
    "pallas"; bad shapes are named."""
    args, _ = make_index_case(rng, counts=[[3], [9]], heads=4, k=16, rows=8, n_table=2,
                              pool_dtype=jnp.bfloat16, q_dtype=jnp.float32)
    run = lambda impl: (lambda *a: paged_index_scores(*a, scale=SCALE, impl=impl))
    assert _has_pallas_call(run("pallas"), *args)
    assert not _has_pallas_call(run("reference"), *args)
    assert _has_pallas_call(run("auto"), *args) == (jax.default_backend() == "gpu")
    chunk, _ = make_index_case(rng, counts=[[3, 4]], heads=4, k=16, rows=8, n_table=2,
                               pool_dtype=jnp.bfloat16, q_dtype=jnp.float32)
    assert not _has_pallas_call(run("auto"), *chunk)
    shape = jax.ShapeDtypeStruct
    assert index_supports(shape((1, 1, 4, 32), jnp.float32), shape((4, 8, 32), jnp.bfloat16))
    assert not index_supports(shape((1, 1, 4, 48), jnp.float32), shape((4, 8, 48), jnp.bfloat16))
    assert not index_supports(shape((1, 1, 4, 32), jnp.float32), shape((4, 6, 32), jnp.bfloat16))
    odd = (np.zeros((1, 1, 4, 48), np.float32), np.zeros((1, 1, 4), np.float32),
           np.zeros((3, 4, 48), np.float32), np.zeros((1, 2), np.int32), np.ones((1, 1), np.int32))
    with pytest.raises(ValueError, match="shapes the kernel does not take"):
        paged_index_scores(*odd, scale=SCALE, impl="pallas")
    assert paged_index_scores(*odd, scale=SCALE).shape == (1, 1, 8)  # auto: the reference
    with pytest.raises(ValueError, match=r"weights has shape \(1, 1, 3\), expected \(1, 1, 4\)"):
        paged_index_scores(odd[0], odd[1][..., :3], *odd[2:], scale=SCALE)
    with pytest.raises(ValueError, match="block_table has shape"):
        paged_index_scores(*odd[:3], odd[3][0], odd[4], scale=SCALE)


def test_index_scores_reference_reads_only_the_table_pages():
    """Its buffers follow the table, not the pool (as the MLA reference's)."""
    shape = jax.ShapeDtypeStruct
    q, w = shape((2, 1, 4, 32), jnp.float32), shape((2, 1, 4), jnp.float32)
    table, counts = shape((2, 6), jnp.int32), shape((2, 1), jnp.int32)
    temp = []
    for n_pages in (16, 65536):
        compiled = jax.jit(paged_index_scores_reference, static_argnames="scale").lower(
            q, w, shape((n_pages, 8, 32), jnp.bfloat16), table, counts, scale=SCALE).compile()
        temp.append(compiled.memory_analysis().temp_size_in_bytes)
    assert temp[0] == temp[1]


def test_gather_rows_reads_entries_by_id(rng):
    """paged.gather_rows: entry g of a row from page table[row, g // rows], row g % rows."""
    pool = jnp.asarray(rng.standard_normal((7, 4, 3)), jnp.float32)
    table = jnp.asarray(rng.permutation(7)[:6].reshape(2, 3), jnp.int32)
    ids = jnp.asarray(rng.integers(0, 12, (2, 5, 2)), jnp.int32)
    got = paged.gather_rows(pool, table, ids)
    want = jax.vmap(lambda rows, i: rows[i])(paged.gather(pool, table), ids)
    assert got.shape == (2, 5, 2, 3)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("rows,tile", [(64, None), (32, None), (64, (128, 4, 2))])
def test_index_scores_kernel_lowers_to_triton_for_cuda(rows, tile):
    """The lowering at DeepSeek-V4.1-Flash shapes (32 index heads of 128, bf16 keys; pages of 64
    tokens: 64 entries of a ratio-1 source, 32 of a ratio-2 one; a table of 2,048 pages)."""
    from jax import export

    shape = jax.ShapeDtypeStruct
    kernel = jax.jit(lambda *a: paged_index_scores_pallas(*a, scale=SCALE, tile=tile))
    exported = export.export(kernel, platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        shape((4, 1, 32, 128), jnp.float32), shape((4, 1, 32), jnp.float32),
        shape((4096, rows, 128), jnp.bfloat16), shape((4, 2048), jnp.int32), shape((4, 1), jnp.int32))
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()
