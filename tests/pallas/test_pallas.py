"""Kernels (Pallas interpret mode on CPU) and their jnp references against float64 numpy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tidejax.ops import moe_grouped
from tidejax.pallas.demand import Demand
from tidejax.pallas.moe import moe_grouped_reference
from tidejax.pallas.moe_kernel import TILES, choose_tile, moe_grouped_pallas
from tests.support.moe_cases import gpt_oss_case, make_bank, numpy_moe, random_picks, rel_err


# (format, slots, tokens, k) with the kernel's own tile choice: decode-like (16-row dot tiles: on
# 8 slots the picks share experts, so no GEMV; PATHS below forces it) and prefill-like (64-row)
CASES = [("bf16", 8, 3, 2), ("mxfp4", 8, 5, 3), ("bf16", 4, 150, 2), ("mxfp4", 4, 150, 2)]


@pytest.mark.parametrize("fmt,n,t,k", CASES)
@pytest.mark.parametrize("limit", [0.0, 0.6])
def test_moe_kernel_interpret_matches_float64(rng, fmt, n, t, k, limit):
    bank, gate_up, down = make_bank(rng, fmt, n, d=64, i=32)
    x = rng.standard_normal((t, 64)).astype(np.float32)
    slot_ids, weights = random_picks(rng, t, k, n)
    want = numpy_moe(x, gate_up, down, slot_ids, weights, limit)
    got = moe_grouped_pallas(x, bank, slot_ids, weights, swiglu_limit=limit, interpret=True)
    assert got.dtype == jnp.float32 and got.shape == x.shape
    assert rel_err(got, want) < 2e-2  # bf16 inputs to the dots, float32 accumulation


# (tile, tolerance): GEMV (bt = 1) in float32; dots (bt 16) on bf16 activations. Tiles sized for
# hidden 64, intermediate 32: several K steps each.
PATHS = [((1, 16, 64, 4, 1), 1e-5), ((1, 8, 32, 2, 1), 1e-5), ((16, 16, 32, 4, 1), 2e-2)]


@pytest.mark.parametrize("tile,tol", PATHS)
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("t", [1, 4, 16])
def test_moe_kernel_paths_match_float64(rng, tile, tol, fmt, t):
    n, k, limit = 8, 3, 0.6 if t == 4 else 0.0
    bank, gate_up, down = make_bank(rng, fmt, n, d=64, i=32)
    x = rng.standard_normal((t, 64)).astype(np.float32)
    slot_ids, weights = random_picks(rng, t, k, n)
    slot_ids[0, :2] = -1, 0  # a skipped pick, and a live one: the output is never all zeros
    want = numpy_moe(x, gate_up, down, slot_ids, weights, limit)
    got = moe_grouped_pallas(x, bank, slot_ids, weights, swiglu_limit=limit, interpret=True,
                             tile=tile)
    assert rel_err(got, want) < tol


def test_tile_follows_the_picks_an_expert_gets():
    # DeepSeek-V4.1-Flash: 384 slots, 6 picks a token; GEMV while experts are rarely shared
    # (up to 2 picks a used expert for MXFP4, whose dots cost more to decode; 1.15 for bf16)
    got = [choose_tile("mxfp4", 6 * t, 384)[0] for t in (1, 4, 16, 64, 128, 512, 4096)]
    assert got == [1, 1, 1, 1, 16, 16, 64]
    got = [choose_tile("dense", 6 * t, 384)[0] for t in (1, 4, 16, 64)]
    assert got == [1, 1, 1, 16]
    assert choose_tile("dense", 6, 48) == TILES["gemv"]
    assert choose_tile("dense", 80, 4)[0] == 32


@pytest.mark.parametrize("fmt", ["f32", "bf16", "mxfp4"])
@pytest.mark.parametrize("t", [3, 40])  # gathers the picked slots / scans over the slots
def test_reference_matches_float64(rng, fmt, t):
    n, k = 12, 3
    bank, gate_up, down = make_bank(rng, fmt, n, d=64, i=32)
    x = rng.standard_normal((t, 64)).astype(np.float32)
    slot_ids, weights = random_picks(rng, t, k, n)
    want = numpy_moe(x, gate_up, down, slot_ids, weights, 0.5)
    got = jax.jit(moe_grouped_reference, static_argnames="swiglu_limit")(
        x, bank, slot_ids, weights, swiglu_limit=0.5)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("fmt", ["f32", "mxfp4"])
@pytest.mark.parametrize("t", [3, 40])  # gathers the picked slots / scans over the slots
def test_reference_with_biases_and_gpt_oss_activation_matches_float64(rng, fmt, t):
    """gpt-oss's experts (tidejax.contract): bias leaves beside either format, the clamped
    g * sigmoid(1.702 g) * (u + 1)."""
    slot_ids = random_picks(rng, t, 3, 12)[0]
    x, bank, weights, want, form = gpt_oss_case(rng, fmt, 12, slot_ids)
    assert rel_err(moe_grouped(x, bank, slot_ids, weights, **form, impl="auto"), want) < 1e-5


@pytest.mark.parametrize("tile,tol", [((1, 16, 32, 4, 1), 1e-5), ((16, 16, 32, 4, 1), 2e-2)])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_moe_kernel_with_biases_and_gpt_oss_activation_matches_float64(rng, tile, tol, fmt):
    """The kernel's GEMV and dots paths on gpt-oss's experts: 40 tokens each pick the 2 slots,
    one pick skipped, so slot 0's 39 picks and slot 1's 40 fill two 16-row dot tiles each and
    part of a third. Asked for by name (impl="pallas": interpret mode here), the op runs the
    kernel too."""
    slot_ids = np.tile(np.array([[0, 1]], np.int32), (40, 1))
    slot_ids[7, 0] = -1
    x, bank, weights, want, form = gpt_oss_case(rng, fmt, 2, slot_ids)
    got = moe_grouped_pallas(x, bank, slot_ids, weights, **form, interpret=True, tile=tile)
    assert rel_err(got, want) < tol
    if tile[0] == 1:
        assert rel_err(moe_grouped(x, bank, slot_ids, weights, **form, impl="pallas"), want) < 2e-2


def test_auto_on_cpu_is_the_reference_and_keeps_dtype(rng):
    bank, _, _ = make_bank(rng, "bf16", 6, 32, 32)
    x = jnp.asarray(rng.standard_normal((4, 32)), jnp.bfloat16)
    slot_ids, weights = random_picks(rng, 4, 2, 6)
    y = moe_grouped(x, bank, slot_ids, weights)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  np.asarray(moe_grouped_reference(x, bank, slot_ids, weights), np.float32))


def test_bad_bank_and_shapes_are_named():
    x = np.zeros((2, 32), np.float32)
    ids, w = np.zeros((2, 1), np.int32), np.ones((2, 1), np.float32)
    with pytest.raises(ValueError, match="expected .*'down', 'gate_up'"):
        moe_grouped(x, {"gate_up": np.zeros((1, 64, 32))}, ids, w)
    bank = {"gate_up": np.zeros((1, 64, 32), np.float32), "down": np.zeros((1, 32, 32), np.float32)}
    with pytest.raises(ValueError, match="x has shape"):
        moe_grouped(np.zeros((2, 16), np.float32), bank, ids, w)
    with pytest.raises(ValueError, match="impl='cuda'"):
        moe_grouped(x, bank, ids, w, impl="cuda")


def numpy_counts(counts, sums, layer, ids, weights, mask):
    counts, sums = counts.astype(np.float64), sums.astype(np.float64)
    for t, j in np.ndindex(ids.shape):
        if mask[t] and ids[t, j] >= 0:
            counts[layer, ids[t, j]] += 1
            sums[layer, ids[t, j]] += weights[t, j]
    return counts, sums


# the grouped kernel's two shapes, forced (hidden 64, intermediate 32), and the reference
DEMAND_PATHS = [(1, 16, 64, 4, 1), (16, 16, 32, 4, 1), "reference"]


@pytest.mark.parametrize("path", DEMAND_PATHS)
@pytest.mark.parametrize("t", [1, 37])
def test_demand_counted_in_moe_grouped_matches_loop(rng, path, t):
    n_layers, n_experts, n_slots, k, layer = 3, 16, 8, 3, 2
    bank, _, _ = make_bank(rng, "bf16", n_slots, d=64, i=32)
    x = rng.standard_normal((t, 64)).astype(np.float32)
    ids = np.stack([rng.permutation(n_experts)[:k] for _ in range(t)]).astype(np.int32)
    ids[rng.random((t, k)) < 0.1] = -1  # no wanted expert
    weights = rng.random((t, k)).astype(np.float32)
    mask = rng.random(t) > 0.25
    mask[0] = True
    rowmap = np.full(n_experts, -1, np.int32)  # half the experts resident
    rowmap[rng.permutation(n_experts)[:n_slots]] = np.arange(n_slots)
    slot_ids = np.where(mask[:, None] & (ids >= 0), rowmap[ids], -1).astype(np.int32)
    ids[0, 0], slot_ids[0, 0] = np.flatnonzero(rowmap < 0)[0], -1  # a miss: no slot, still counted
    counts = rng.integers(0, 50, (n_layers, n_experts)).astype(np.float32)
    sums = rng.random((n_layers, n_experts)).astype(np.float32)
    demand = Demand(counts, sums, layer, ids, weights, mask)
    if path == "reference":
        y, got_counts, got_sums = moe_grouped(x, bank, slot_ids, weights, demand=demand)
        y_alone = moe_grouped(x, bank, slot_ids, weights)
    else:
        run = functools.partial(moe_grouped_pallas, x, bank, slot_ids, weights, interpret=True, tile=path)
        y, got_counts, got_sums = run(demand=demand)
        y_alone = run()
    want_counts, want_sums = numpy_counts(counts, sums, layer, ids, weights, mask)
    assert want_counts[layer, ids[0, 0]] > counts[layer, ids[0, 0]]
    np.testing.assert_array_equal(np.asarray(got_counts), want_counts)
    np.testing.assert_allclose(np.asarray(got_sums), want_sums, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_alone))  # counting leaves y alone


def test_demand_of_another_shape_or_dtype_is_named():
    x = np.zeros((2, 32), np.float32)
    bank = {"gate_up": np.zeros((1, 64, 32), np.float32), "down": np.zeros((1, 32, 32), np.float32)}
    ids, w = np.zeros((2, 1), np.int32), np.ones((2, 1), np.float32)
    counters = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match=r"demand: ids \(3, 1\)"):
        moe_grouped(x, bank, ids, w, demand=Demand(counters, counters, 0, np.zeros((3, 1), np.int32), w,
                                                   np.ones(2, bool)))
    with pytest.raises(ValueError, match="demand: counts"):
        moe_grouped_pallas(x, bank, ids, w, interpret=True, demand=Demand(
            counters, counters[:1], 0, ids, w, np.ones(2, bool)))
    with pytest.raises(ValueError, match="expected float32"):
        moe_grouped(x, bank, ids, w, demand=Demand(counters, counters.astype(jnp.bfloat16), 0, ids, w,
                                                   np.ones(2, bool)))


def test_kernel_e2m1_decoding_covers_every_code():
    from tidejax.checkpoint.mxfp4 import E2M1_VALUES
    from tidejax.pallas.moe_kernel import e2m1_f16_f32

    codes = jnp.arange(16, dtype=jnp.uint32)
    for shift, byte in ((0, codes), (4, codes << 4 | (15 - codes))):  # the other nibble is noise
        got = jax.jit(e2m1_f16_f32, static_argnums=1)(byte, shift)
        np.testing.assert_array_equal(np.asarray(got) * 2.0**14, E2M1_VALUES)


def test_kernel_ptx_shift_table_decodes_every_byte():
    """The GPU kernel's PTX decode (tidejax.pallas.moe_kernel.PAIR_SHIFTS / PAIR_MASKS) replayed in
    numpy on words holding every byte value: each 16-bit half is the fp16 of the e2m1 value
    times 2**-14 of its byte's nibble (the PTX itself only runs on a GPU: bench/kernels.py checks
    it there)."""
    from tidejax.checkpoint.mxfp4 import E2M1_VALUES
    from tidejax.pallas.moe_kernel import PAIR_MASKS, PAIR_SHIFTS

    byte_values = np.arange(256, dtype=np.uint32)
    words = byte_values | np.roll(byte_values, 1) << 8 | np.roll(byte_values, 2) << 16 | np.roll(byte_values, 3) << 24
    shift = lambda w, n: w << np.uint32(n) if n >= 0 else w >> np.uint32(-n)
    for nibble, shifts in PAIR_SHIFTS.items():
        for j, (m, sign) in enumerate(shifts):  # pair j holds bytes j (low half) and j + 2
            pair = (shift(words, m) & np.uint32(PAIR_MASKS[0])) | (shift(words, sign) & np.uint32(PAIR_MASKS[1]))
            halves = pair.astype("<u4").view(np.float16).reshape(-1, 2).astype(np.float64) * 2.0**14
            for half, byte in ((0, j), (1, j + 2)):
                codes = (words >> np.uint32(8 * byte + nibble)) & np.uint32(15)
                np.testing.assert_array_equal(halves[:, half], E2M1_VALUES[codes])


def test_kernels_lower_to_triton_for_cuda():
    """The Pallas -> Triton lowering runs on a CPU machine too: catch lowering errors here."""
    from jax import export

    shape = jax.ShapeDtypeStruct
    d, i, n, t, k = 256, 128, 8, 5, 2
    banks = [
        {"gate_up": shape((n, 2 * i, d), jnp.bfloat16), "down": shape((n, d, i), jnp.bfloat16)},
        {"gate_up_blocks": shape((n, 2 * i, d // 32, 16), jnp.uint8),
         "gate_up_scales": shape((n, 2 * i, d // 32), jnp.uint8),
         "down_blocks": shape((n, d, i // 32, 16), jnp.uint8), "down_scales": shape((n, d, i // 32), jnp.uint8)},
    ]
    biases = {"gate_up_bias": shape((n, 2 * i), jnp.bfloat16),
              "down_bias": shape((n, d), jnp.bfloat16)}
    banks += [{**bank, **biases} for bank in banks]  # gpt-oss's, with its activation's variant
    triton_ok = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for bank in banks:
        form = dict(swiglu_limit=7.0, swiglu_alpha=1.702, swiglu_up_shift=1.0) if (
            "down_bias" in bank) else {}
        for tokens, tile in ((t, None), (300, None), (t, (16, 32, 128, 4, 1)), (300, (64, 64, 64, 4, 2))):
            picks = shape((tokens, k), jnp.int32), shape((tokens, k), jnp.float32)
            counters = shape((3, 2 * n), jnp.float32)
            # the counting fused in (layer traced) or not
            for demand in (None, Demand(counters, counters, shape((), jnp.int32), *picks,
                                        shape((tokens,), jnp.bool_))):
                kernel = functools.partial(moe_grouped_pallas, tile=tile, **form)
                exported = export.export(jax.jit(kernel), platforms=["cuda"], disabled_checks=triton_ok)(
                    shape((tokens, d), jnp.bfloat16), bank, *picks, demand=demand)
                assert exported.mlir_module().count("xla.gpu.triton") == 2


def test_auto_takes_the_kernel_only_for_shapes_it_supports(monkeypatch):
    from tidejax.ops import dispatch
    from tidejax.pallas.moe_kernel import pallas_supports

    fits = {"gate_up": np.zeros((2, 64, 64), np.float32), "down": np.zeros((2, 64, 32), np.float32)}
    odd = {"gate_up": np.zeros((2, 48, 40), np.float32), "down": np.zeros((2, 40, 24), np.float32)}
    assert pallas_supports(fits) and not pallas_supports(odd)
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    assert dispatch.choose_impl("moe_grouped", "auto", fits=lambda: pallas_supports(fits)) == "pallas"
    assert dispatch.choose_impl("moe_grouped", "auto", fits=lambda: pallas_supports(odd)) == "reference"
    assert dispatch.choose_impl("moe_grouped", "pallas", fits=lambda: False) == "pallas"


def test_auto_takes_the_kernel_for_gpt_oss_experts_where_it_fits(monkeypatch):
    """On a GPU, "auto" runs gpt-oss's experts (bias leaves, g * sigmoid(1.702 g) * (u + 1)) on
    the kernel where it takes the bank's shapes, and on the reference where it does not."""
    from tidejax.ops import dispatch

    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")

    def on_kernel(d, i):
        bank = {"gate_up": jnp.zeros((2, 2 * i, d)), "down": jnp.zeros((2, d, i)),
                "gate_up_bias": jnp.zeros((2, 2 * i)), "down_bias": jnp.zeros((2, d))}
        ids, w = np.zeros((3, 2), np.int32), np.ones((3, 2), np.float32)
        jaxpr = jax.make_jaxpr(lambda x: moe_grouped(
            x, bank, ids, w, swiglu_limit=7.0, swiglu_alpha=1.702, swiglu_up_shift=1.0))(
            np.zeros((3, d), np.float32))
        return "pallas_call" in str(jaxpr)

    assert on_kernel(64, 32) and not on_kernel(40, 24)

