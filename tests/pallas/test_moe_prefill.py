"""The prompt chunk's grouped MoE as a Triton grouped GEMM (pallas.moe_prefill; Triton's
interpreter on the CPU) against moe_grouped_reference and float64 numpy, its compile for Hopper
(sm_90, on the CPU), and its place in ops.moe_grouped's dispatch."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tidejax import ops
from tidejax.pallas import moe_prefill
from tidejax.pallas.bank import bank_dims
from tidejax.pallas.demand import Demand, count_demand_reference
from tidejax.pallas.moe import moe_grouped_reference
from tests.support.moe_cases import gpt_oss_case, make_bank, random_picks, rel_err


def prompt_picks(rng, t, k, used):
    """[t, k] distinct slots a token among the first `used` (a bank of more slots has experts
    with no picks), about a tenth skipped (-1); weights [t, k]."""
    slot_ids, weights = random_picks(rng, t, k, used)
    slot_ids[0, :2] = -1, 0  # a skipped pick, and a live one
    return slot_ids, weights


# (format, slots, slots picked, tokens, k, limit): tiles of BM = 64 rows; 150 tokens x 2 picks
# over 3 slots fill two tiles a slot and part of a third, 37 x 3 over 5 part of one each (T not
# a multiple of BM either way); slot 3 (and 5+) get no picks
CASES = [("bf16", 4, 3, 150, 2, 0.6), ("mxfp4", 4, 3, 150, 2, 0.0), ("bf16", 8, 5, 37, 3, 0.0),
         ("mxfp4", 8, 5, 37, 3, 0.6)]


@pytest.mark.parametrize("fmt,n,used,t,k,limit", CASES)
def test_the_kernel_computes_the_reference(rng, fmt, n, used, t, k, limit):
    bank, _, _ = make_bank(rng, fmt, n, d=64, i=32)
    x = jnp.asarray(rng.standard_normal((t, 64)), jnp.bfloat16)
    slot_ids, weights = prompt_picks(rng, t, k, used)
    want = moe_grouped_reference(x.astype(jnp.float32), bank, slot_ids, weights,
                                 swiglu_limit=limit)
    got = moe_prefill.moe_grouped_triton(x, bank, slot_ids, weights, swiglu_limit=limit,
                                         interpret=True)
    assert got.dtype == jnp.bfloat16 and got.shape == x.shape
    # bf16 x and h into the dots, float32 accumulation, the output rounded to bf16
    assert rel_err(np.asarray(got, np.float32), np.asarray(want, np.float64)) < 2e-2
    assert not np.any(np.asarray(got[slot_ids.max(1) < 0], np.float32))  # no picks: zeros


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_another_tile_computes_the_same(rng, fmt):
    """tile= (the bench's sweep) runs the kernel at other tiles: BM 16 (more tiles a slot), BN 32
    (two programs of down's 64 columns), BK 32 (gate_up's K in two steps); the module's result
    but for the sums' order (the same bf16 operands), within the output's bf16 rounding; a tile
    the kernel cannot take is named."""
    bank, _, _ = make_bank(rng, fmt, 4, d=64, i=32)
    x = jnp.asarray(rng.standard_normal((150, 64)), jnp.bfloat16)
    slot_ids, weights = prompt_picks(rng, 150, 2, 3)
    want = moe_prefill.moe_grouped_triton(x, bank, slot_ids, weights, interpret=True)
    got = moe_prefill.moe_grouped_triton(x, bank, slot_ids, weights, interpret=True,
                                         tile=(16, 32, 32, 4, 2))
    assert rel_err(np.asarray(got, np.float32), np.asarray(want, np.float64)) < 4e-3
    with pytest.raises(ValueError, match=r"tile=\(16, 8, 64, 4, 2\)"):
        moe_prefill.moe_grouped_triton(x, bank, slot_ids, weights, interpret=True,
                                       tile=(16, 8, 64, 4, 2))


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_gpt_oss_biases_and_activation(rng, fmt):
    """gpt-oss's experts (tidejax.contract): the bias leaves and g * sigmoid(1.702 g) * (u + 1),
    compiled in, against float64 numpy."""
    slot_ids = prompt_picks(rng, 90, 2, 3)[0]
    x, bank, weights, want, form = gpt_oss_case(rng, fmt, 4, slot_ids)
    got = moe_prefill.moe_grouped_triton(x, bank, slot_ids, weights, **form, interpret=True)
    assert rel_err(got, want) < 2e-2


def test_demand_is_counted(rng):
    """With `demand`, the counters of count_demand_reference beside the same y."""
    bank, _, _ = make_bank(rng, "bf16", 4, d=64, i=32)
    x = rng.standard_normal((40, 64)).astype(np.float32)
    slot_ids, weights = prompt_picks(rng, 40, 2, 4)
    counters = jnp.asarray(rng.integers(0, 9, (3, 6)), jnp.float32)
    mask = jnp.asarray(rng.random(40) > 0.2)
    demand = Demand(counters, counters, 1, jnp.asarray(slot_ids), weights, mask)
    y, counts, sums = moe_prefill.moe_grouped_triton(x, bank, slot_ids, weights, demand=demand,
                                                     interpret=True)
    want = count_demand_reference(*demand)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(sums), np.asarray(want[1]), rtol=1e-6)
    alone = moe_prefill.moe_grouped_triton(x, bank, slot_ids, weights, interpret=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(alone))


def compile_for_hopper(fmt: str, gate_up: bool, bias: bool, tile: tuple, d=7168, i=2048):
    """The kernel's pass compiled by Triton for sm_90 on this CPU (DeepSeek-V3's expert shapes
    by default), at tile (BM, BN, BK, num_warps, num_stages): its ptx, after checking it has a
    cubin on warpgroup MMAs (wgmma) and loads pipelined by asynchronous copies (cp.async)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tidejax.pallas.moe_prefill_kernel import moe_prefill_kernel

    bm, bn, bk, warps, stages = tile
    weight = "*u8" if fmt == "mxfp4" else "*bf16"
    meta = dict(K=d if gate_up else i, R=2 * i if gate_up else d, N=i if gate_up else d,
                PHASES=2 if fmt == "mxfp4" else 1, BM=bm, BN=bn, BK=bk, GATE_UP=gate_up,
                BIAS=bias, LIMIT=7.0 if bias else 0.0, ALPHA=1.702 if bias else 1.0,
                UP_SHIFT=1.0 if bias else 0.0, DOT_F32=False)
    signature = dict(a_ptr="*bf16", tile_slot_ptr="*i32", row_token_ptr="*i32",
                     row_weight_ptr="*fp32", w_ptr=weight, scale_ptr=weight, bias_ptr="*bf16",
                     out_ptr="*bf16" if gate_up else "*fp32",
                     **{name: "constexpr" for name in meta})
    aligned = {(j,): [["tt.divisibility", 16]] for j in range(8)}  # as jax-triton's arrays
    compiled = triton.compile(ASTSource(moe_prefill_kernel, signature, meta, aligned),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"] and "wgmma" in ptx and "cp.async" in ptx  # pipelined
    return ptx


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_the_kernel_compiles_for_hopper(fmt):
    """Triton compiles every variant (both passes, with and without the bias and the activation's
    options) at the module's tile for sm_90 on this CPU: the GPU path's errors, which the
    interpreter does not see, show here."""
    tile = (moe_prefill.BM, moe_prefill.BN, moe_prefill.BK, moe_prefill.NUM_WARPS,
            moe_prefill.NUM_STAGES)
    for gate_up in (True, False):
        for bias in (False, True):
            compile_for_hopper(fmt, gate_up, bias, tile)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_the_bench_tiles_compile_for_hopper(fmt):
    """Each of bench/kernels.py's PREFILL_TILES (the --prefill-tiles sweep) compiles both passes
    for sm_90 at DeepSeek-V4.1-Flash's expert shapes; the module's tile is the sweep's first."""
    from bench.kernels import PREFILL_TILES

    assert PREFILL_TILES[0] == (moe_prefill.BM, moe_prefill.BN, moe_prefill.BK,
                                moe_prefill.NUM_WARPS, moe_prefill.NUM_STAGES)
    for tile in PREFILL_TILES:
        for gate_up in (True, False):
            compile_for_hopper(fmt, gate_up, False, tile, d=5120, i=2304)


def on_triton(bank, t, k, **kwargs) -> bool:
    """Whether ops.moe_grouped (impl "pallas") runs t tokens x k picks (slots 0..k-1 each) on
    the Triton kernel (its interpreter: a host callback) rather than Pallas's (a pallas_call)."""
    ids, w = np.zeros((t, k), np.int32) + np.arange(k), np.ones((t, k), np.float32)
    x = np.zeros((t, bank_dims(bank)[1]), np.float32)
    jaxpr = str(jax.make_jaxpr(lambda x: ops.moe_grouped(x, bank, ids, w, impl="pallas",
                                                         **kwargs))(x))
    assert ("pallas_call" in jaxpr) != ("pure_callback" in jaxpr)
    return "pure_callback" in jaxpr


def test_dispatch_takes_it_for_prompt_chunks_only_where_chosen(rng):
    """The default (ops.dispatch.MOE_PREFILL, "pallas_dots" until timed) keeps Pallas's dots;
    prefill="triton" takes the Triton kernel for a prompt chunk's many picks an expert, not for
    decode's few, nor for a bank it does not take (float32 weights); a bank of several layers'
    slots counts them over the layer's n_experts; results as the reference's."""
    assert ops.dispatch.MOE_PREFILL == "pallas_dots"
    # DeepSeek-V4.1-Flash (384 slots, 6 picks a token): prompt chunks of 1,024 and 2,048 tokens
    assert [moe_prefill.fills_tiles(6 * t, 384) for t in (4, 512, 1024, 2048)] == [
        False, False, True, True]
    bank, _, _ = make_bank(rng, "bf16", 4, d=64, i=32)
    assert not on_triton(bank, 200, 2)
    assert on_triton(bank, 200, 2, prefill="triton")
    assert not on_triton(bank, 2, 2, prefill="triton")  # 1 pick an expert
    # 40 slots (5 layers' 8), picks among one layer's: 20 an expert, a quarter tile and more
    layers, _, _ = make_bank(rng, "bf16", 40, d=64, i=32)
    assert not on_triton(layers, 80, 2, prefill="triton")
    assert on_triton(layers, 80, 2, prefill="triton", n_experts=8)
    f32, _, _ = make_bank(rng, "f32", 4, d=64, i=32)
    assert not moe_prefill.triton_supports(f32, interpret=True)
    assert not on_triton(f32, 200, 2, prefill="triton")
    x = rng.standard_normal((100, 64)).astype(np.float32)
    slot_ids, weights = prompt_picks(rng, 100, 2, 4)
    got = ops.moe_grouped(x, bank, slot_ids, weights, impl="pallas", prefill="triton")
    want = moe_grouped_reference(x, bank, slot_ids, weights)
    assert rel_err(got, np.asarray(want, np.float64)) < 2e-2


def test_pallas_tile_counts_picks_over_the_layers_experts(rng):
    """Pallas's tile too (moe_kernel.choose_tile): 6 tokens x 2 picks in a bank of 40 slots are
    GEMV's ~1 pick an expert; over the layer's 8 (n_experts) ~1.7, the dots."""
    bank, _, _ = make_bank(rng, "bf16", 40, d=64, i=32)
    ids, w = np.zeros((6, 2), np.int32) + np.arange(2), np.ones((6, 2), np.float32)
    x = np.zeros((6, 64), np.float32)
    for n_experts, kernel in ((None, "moe_gate_up_gemv"), (8, "moe_gate_up")):
        jaxpr = str(jax.make_jaxpr(lambda x: ops.moe_grouped(x, bank, ids, w, impl="pallas",
                                                             n_experts=n_experts))(x))
        assert set(re.findall(r"name=(moe_gate_up\w*)", jaxpr)) == {kernel}


def test_bad_choices_and_banks_are_named(rng):
    bank, _, _ = make_bank(rng, "bf16", 2, d=64, i=32)
    x, ids, w = np.zeros((2, 64), np.float32), np.zeros((2, 1), np.int32), np.ones((2, 1))
    with pytest.raises(ValueError, match="prefill='cuda'"):
        ops.moe_grouped(x, bank, ids, w, prefill="cuda")
    f32, _, _ = make_bank(rng, "f32", 2, d=64, i=32)
    with pytest.raises(ValueError, match="bf16 weights"):
        moe_prefill.moe_grouped_triton(x, f32, ids, w, interpret=True)
    odd = {"gate_up": jnp.zeros((2, 48, 40), jnp.bfloat16), "down": jnp.zeros((2, 40, 24),
                                                                              jnp.bfloat16)}
    with pytest.raises(ValueError, match="hidden 40, intermediate 24"):
        moe_prefill.moe_grouped_triton(np.zeros((2, 40), np.float32), odd, ids, w, interpret=True)


# StableHLO tensor types: dims and element type
TENSOR = re.compile(r"tensor<((?:\d+x)+)(f32|bf16|f16|f64|ui8|i8|i32|i64|i1)>")
BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "ui8": 1, "i8": 1, "i32": 4, "i64": 8, "i1": 1}


@pytest.mark.parametrize("n,t", [(384, 4096), (32, 1024)])
def test_mxfp4_reads_packed_bytes_only(n, t):
    """DeepSeek-V4.1-Flash's MXFP4 bank (hidden 5120, intermediate 2304) at the bench's shapes:
    its whole bank at 4,096 tokens, the check's 32 slots at 1,024. Lowered on abstract shapes
    (nothing allocated): no float tensor as large as the packed gate_up bytes (a projection
    decoded to bf16 or float32 is 4x or 8x those), and the compiled step's temporaries below
    the packed bank. The host callback stands in for jax-triton's launch: the jnp around it is
    the GPU path's, and the kernel reads the bytes through pointers."""
    d, i, k = 5120, 2304, 6
    u8 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.uint8)
    bank = {"gate_up_blocks": u8(n, 2 * i, d // 32, 16), "gate_up_scales": u8(n, 2 * i, d // 32),
            "down_blocks": u8(n, d, i // 32, 16), "down_scales": u8(n, d, i // 32)}
    args = (jax.ShapeDtypeStruct((t, d), jnp.float32), bank,
            jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((t, k), jnp.float32))
    lowered = jax.jit(functools.partial(moe_prefill.moe_grouped_triton, swiglu_limit=7.0,
                                        interpret=True)).lower(*args)
    packed = sum(math.prod(a.shape) for a in bank.values())
    floats = [math.prod(map(int, dims[:-1].split("x"))) * BYTES[dtype]
              for dims, dtype in TENSOR.findall(lowered.as_text()) if dtype.startswith(("f", "b"))]
    assert max(floats) < math.prod(bank["gate_up_blocks"].shape), max(floats)
    assert lowered.compile().memory_analysis().temp_size_in_bytes < packed
