"""The `cpu` miss policy: the host kernel against float64 numpy on every path this CPU runs, the
policy against all-resident (the demo model, a V4.1 golden), and the picks it counted."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tidejax
from tests.support.residency_fixtures import E, L, make_pool, make_router, tokens, toy_step
from tidejax.checkpoint import mxfp4
from tidejax.residency import cpu
from tidejax.residency.planner import place
from tidejax.residency.pool import host_pool
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import build_state

REPO = Path(__file__).resolve().parents[2]
GOLDEN_V41 = Path(__file__).parents[1] / "data" / "golden_v41" / "tiny_a"
U = 2.0 ** -24  # float32 unit roundoff


def _pool(fmt: str, n: int, d: int, inter: int, seed: int) -> tuple[dict, dict]:
    """(bank-format numpy pool, its float64 values {"gate_up", "down"})."""
    r = np.random.default_rng(seed)
    gate_up = r.standard_normal((n, 2 * inter, d)) * 0.4
    down = r.standard_normal((n, d, inter)) * 0.4
    if fmt == "mxfp4":
        pool = {}
        for name, w in (("gate_up", gate_up), ("down", down)):
            pool[f"{name}_blocks"], pool[f"{name}_scales"] = mxfp4.quantize(w)
        exact = {name: mxfp4.dequantize(pool[f"{name}_blocks"], pool[f"{name}_scales"], np.float64)
                 for name in ("gate_up", "down")}
        return pool, exact
    dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[fmt]
    pool = {"gate_up": gate_up.astype(dtype), "down": down.astype(dtype)}
    return pool, {k: v.astype(np.float64) for k, v in pool.items()}


def _reference(exact, x, rows, toks, weights, limit):
    """float64: (y [T, D], the error bound B of each element, cpu.py's docstring)."""
    x = x.astype(np.float64)
    d = x.shape[1]
    inter = exact["down"].shape[2]
    y, bound = np.zeros_like(x), np.zeros_like(x)
    for p, (row, t, w) in enumerate(zip(rows, toks, weights)):
        gu, down = exact["gate_up"][row], exact["down"][row]
        g, u = np.split(gu @ x[t], 2)
        mag_g, mag_u = np.split(np.abs(gu) @ np.abs(x[t]), 2)
        if limit > 0:
            g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
        silu = g / (1 + np.exp(-g))
        act = silu * u
        k = np.count_nonzero(toks == t)
        y[t] += w * (down @ act)
        carried = 1.1 * np.abs(u) * mag_g + np.abs(silu) * mag_u  # SwiGLU of the dots' error
        bound[t] += abs(w) * U * ((inter + k + 4) * (np.abs(down) @ np.abs(act))
                                  + d * (np.abs(down) @ carried))
    return y, bound


def _picks(r, n_rows, t, k):
    """k distinct rows for each of t tokens, token 0's first row shared by every token (so one
    expert serves more tokens than one pass of the kernel takes)."""
    rows = np.stack([r.choice(n_rows, k, replace=False) for _ in range(t)])
    rows[:, 0] = rows[0, 0]
    toks = np.repeat(np.arange(t), k)
    return rows.reshape(-1), toks, r.random(t * k).astype(np.float32)


@pytest.mark.parametrize("isa", cpu.available_isas())
@pytest.mark.parametrize("fmt,d,inter,limit", [
    ("mxfp4", 96, 64, 0.0), ("mxfp4", 64, 96, 1.5), ("float32", 40, 24, 0.0),
    ("bfloat16", 48, 40, 2.0)])
def test_host_kernel_matches_float64(isa, fmt, d, inter, limit):
    r = np.random.default_rng(7)
    pool, exact = _pool(fmt, 6, d, inter, seed=3)
    t, k = 6, 3
    x = r.standard_normal((t, d)).astype(np.float32)
    rows, toks, weights = _picks(r, 6, t, k)
    got = cpu.moe_host(pool, x, rows, toks, weights, limit, isa)
    want, bound = _reference(exact, x, rows, toks, weights, limit)
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))  # far inside B in practice


def test_the_simd_path_runs_where_the_cpu_has_it():
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx512f" in flags:
        assert cpu.kernel_isa() == "avx512"
    elif " avx2" in flags and " fma" in flags:
        assert cpu.kernel_isa() == "avx2"
    else:
        pytest.skip("this CPU has neither AVX-512 nor AVX2")


def test_host_kernel_refuses_bad_picks():
    pool, _ = _pool("mxfp4", 4, 64, 32, seed=0)
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="out of range"):
        cpu.moe_host(pool, x, np.array([4]), np.array([0]), np.ones(1, np.float32))
    with pytest.raises(ValueError, match=r"x has shape \(2, 32\)"):
        cpu.moe_host(pool, x[:, :32], np.array([0]), np.array([0]), np.ones(1, np.float32))
    with pytest.raises(ValueError, match="isa='avx9'"):
        cpu.moe_host(pool, x, np.array([0]), np.array([0]), np.ones(1, np.float32), isa="avx9")


def test_the_custom_call_computes_the_misses_inside_the_jit():
    """Where the extension is built (CI builds it with jaxlib's FFI headers) the step calls the
    kernel as an XLA custom call, not through pure_callback, and counts its picks in C."""
    if cpu.kernel_isa() == "numpy":
        pytest.skip("the extension is not built")
    assert cpu.ffi_platform() == "cpu"
    pool, exact = _pool("mxfp4", 2 * 4, 64, 32, seed=3)
    placed = host_pool(pool)  # the views hold no reference: the pool must outlive the calls
    experts = cpu.CpuExperts(placed, n_experts=4)
    assert experts.handle is not None
    r = np.random.default_rng(4)
    x = r.standard_normal((3, 64)).astype(np.float32)
    ids = np.array([[0, 3], [1, 2], [3, 1]], np.int32)
    weights = r.random((3, 2)).astype(np.float32)
    miss = np.array([[True, False], [True, True], [False, True]])
    serve = jax.jit(lambda *a: experts.serve(1, *a, swiglu_limit=0.0))
    assert cpu.FFI_TARGET in serve.lower(x, ids, weights, miss).as_text()
    assert "callback" not in serve.lower(x, ids, weights, miss).as_text()
    tokens_, ks = np.nonzero(miss)
    rows = 4 + ids[tokens_, ks]
    want, bound = _reference(exact, x, rows, tokens_, weights[tokens_, ks], 0.0)
    got = np.asarray(serve(x, ids, weights, miss))
    assert np.all(np.abs(got - want) <= bound)
    assert experts.picks == miss.sum()
    bad = np.array([[7, 0], [0, 0], [0, 0]], np.int32)  # expert 7 of a 4-expert layer
    with pytest.raises(Exception, match="outside the pool"):
        np.asarray(serve(x, bad, weights, miss))


# -- the policy in a jitted step ------------------------------------------------------------------


def test_cpu_policy_needs_its_host_experts():
    pool_np = make_pool()
    half = build_state(host_pool(pool_np), L, place(np.arange(L * E), L * E // 2, L, E,
                                                     "per_layer"))
    with pytest.raises(ValueError, match="miss policy 'cpu' needs"):
        toy_step(half, tokens(0), jnp.ones(4, bool), jnp.asarray(make_router()), jnp.zeros(E),
                 ServeOptions(miss_policy="cpu", kernel="reference"))


def _greedy(engine, prompt, n):
    """n greedy tokens by full forwards (Engine.logits: every length pads to one shape)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(engine.logits(ids)[-1])))
    return ids[len(prompt):]


def test_demo_model_cpu_equals_all_resident():
    """MXFP4 experts, half of them resident: the misses computed by the host kernel."""
    demo = REPO / "models" / "demo"
    opts = dict(model={"experts": "mxfp4"}, engine={"max_context": 64, "prefill_chunk": 16})
    full = tidejax.load(demo, **opts)
    n_moe, n_experts = full.family.expert_dims(full.cfg)[:2]
    half = tidejax.load(demo, residency={"budget_experts": n_moe * n_experts // 2,
                                         "miss_policy": "cpu", "adapt": False}, **opts)
    prompt = full.tokenizer.encode("Once upon a time")
    np.testing.assert_allclose(half.logits(prompt), full.logits(prompt), rtol=0, atol=1e-4)
    assert _greedy(half, prompt, 6) == _greedy(full, prompt, 6)
    half.residency.flush()
    stats = half.residency.stats()
    assert stats["cpu_kernel"] == cpu.kernel_isa()
    assert stats["cpu_picks"] == stats["misses"] > 0  # every miss was computed on the host
    assert half.residency.cpu.reads_in_place(half.state.experts.pool)  # through donated steps


def test_v41_golden_cpu_equals_exact():
    """Half resident, float32 experts: the golden logits (which `exact` and all-resident give,
    tests/models/test_deepseek_v41_engine.py) within the bound, the same greedy choice everywhere."""
    ids = np.load(GOLDEN_V41 / "input_ids.npy")[0][:16]  # the calibration's length: one compile
    want = np.load(GOLDEN_V41 / "logits.npy")[:16]
    on_cpu = tidejax.load(GOLDEN_V41, engine={"max_context": 128, "prefill_chunk": 16},
                          residency={"budget_experts": 24, "miss_policy": "cpu", "adapt": False})
    got = on_cpu.logits(ids)
    assert np.abs(got - want).max() <= 1e-4
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    assert on_cpu.residency.stats()["cpu_picks"] > 0
