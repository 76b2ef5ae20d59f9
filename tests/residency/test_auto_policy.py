"""The `auto` miss policy: heavy misses computed on the host, light ones substituted. On the toy
MoE stack its limits (exact_weight 0 is `cpu`, above 1 `substitute`), the per-step budget and the
cap on the approximate share; on the demo model half resident the approximate share against a
count from the router's own picks and weights, and through the server in x_engine_stats."""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

import tidejax
from tests.support.residency_fixtures import E, K, L, make_pool, make_router, tokens, toy_batch_step
from tests.support.server_fixtures import serve_app
from tidejax.config import EngineConfig, ResidencySection
from tidejax.errors import ConfigError
from tidejax.models.layers.moe import MoE, route
from tidejax.residency import Residency
from tidejax.residency.serve import _exact_picks, weight_shares
from tidejax.runtime.client import LocalEngineClient
from tidejax.server.app import Server

REPO = Path(__file__).resolve().parents[2]
ROUTER = jnp.asarray(make_router())
NO_BIAS = jnp.zeros(E, jnp.float32)


def toy_run(steps=4, **section):
    """`steps` toy steps of 4 tokens, half the experts resident (the same boot map for every
    policy); (the outputs, the Residency, each step's (misses, host picks))."""
    res = Residency(make_pool(), L, K, ResidencySection(
        budget_experts=L * E // 2, adapt=False, drain_every=1000, **section), kernel="reference",
        max_tokens=4)
    state = res.take_state()
    outs, per_step = [], []
    for i in range(steps):
        before = (res.counters["misses"], res.cpu_picks())
        y, state, tallies = toy_batch_step(state, res.next_batch(), tokens(i), jnp.ones(4, bool),
                                           ROUTER, NO_BIAS, res.options)
        res.after_step(tallies, tokens=4)
        res.flush()
        outs.append(np.asarray(y))
        per_step.append((res.counters["misses"] - before[0], res.cpu_picks() - before[1]))
    return outs, res, per_step


def test_auto_at_its_limits_is_cpu_and_substitute():
    """exact_weight 0: every miss computed on the host, as `cpu` (equal to all-resident within
    float32 rounding: tests/residency/test_cpu_policy.py); above 1: every miss substituted."""
    cpu_out, cpu_res, _ = toy_run(miss_policy="cpu")
    all_host, res0, _ = toy_run(miss_policy="auto", exact_weight=0.0)
    for got, want in zip(all_host, cpu_out):
        np.testing.assert_array_equal(got, want)
    s0 = res0.stats()
    assert s0["cpu_picks"] == s0["misses"] == cpu_res.stats()["misses"] > 0
    assert s0["approx_weight_share_total"] == 0.0

    sub_out, sub_res, _ = toy_run(miss_policy="substitute")
    none_host, res2, _ = toy_run(miss_policy="auto", exact_weight=1.5)
    for got, want in zip(none_host, sub_out):
        np.testing.assert_array_equal(got, want)
    s2, sub = res2.stats(), sub_res.stats()
    assert s2["cpu_picks"] == 0
    assert s2["approx_weight_share_total"] == sub["approx_weight_share_total"] > 0


def test_exact_picks_heaviest_first_within_the_step_budget():
    res = Residency(make_pool(), L, K, ResidencySection(budget_experts=L * E // 2,
                                                       miss_policy="auto"), kernel="reference")
    state = res.take_state().replace(exact_weight=jnp.float32(0.25), exact_used=jnp.int32(1))
    miss = jnp.asarray([[True, True], [True, False], [True, True]])
    shares = jnp.asarray([[0.6, 0.4], [0.9, 0.1], [0.2, 0.8]], jnp.float32)
    exact, state = _exact_picks(miss, shares, state, budget=4)
    # at or above 0.25: 0.9, 0.8, 0.6, 0.4; 4 - 1 already used = 3 of them, the heaviest
    np.testing.assert_array_equal(np.asarray(exact), [[True, False], [True, False], [False, True]])
    assert int(state.exact_used) == 4
    exact, state = _exact_picks(miss, shares, state, budget=4)  # the step's budget is spent
    assert not np.asarray(exact).any()


def test_budget_caps_host_picks_a_step():
    _, res, per_step = toy_run(steps=6, miss_policy="auto", exact_weight=0.0, exact_budget=3)
    assert all(host == min(3, misses) for misses, host in per_step), per_step
    assert any(misses > 3 for misses, _ in per_step)  # the cap acted
    assert res.stats()["approx_weight_share_total"] > 0  # past the budget: substituted


def test_cap_on_the_approximate_share_lowers_the_threshold():
    _, free, _ = toy_run(steps=12, miss_policy="auto", exact_weight=0.9)
    _, capped, _ = toy_run(steps=12, miss_policy="auto", exact_weight=0.9, max_approx_share=0.02)
    f, c = free.stats(), capped.stats()
    assert f["exact_weight"] == 0.9 and f["threshold_lowered"] == 0
    assert c["threshold_lowered"] > 0 and c["exact_weight"] < 0.9
    assert c["cpu_picks"] > f["cpu_picks"]
    assert c["approx_weight_share_total"] < f["approx_weight_share_total"]


def test_auto_keys_only_with_auto():
    EngineConfig.from_dict({"residency": {"miss_policy": "auto", "exact_weight": 0.3,
                                          "exact_budget": 16, "max_approx_share": 0.1}})
    with pytest.raises(ConfigError, match="'residency.exact_weight' = 0.3 is read by miss_policy "
                                          "'auto' only"):
        EngineConfig.from_dict({"residency": {"miss_policy": "cpu", "exact_weight": 0.3}})
    with pytest.raises(ConfigError, match="'residency.max_approx_share' = 1.5 should be"):
        EngineConfig.from_dict({"residency": {"miss_policy": "auto", "max_approx_share": 1.5}})
    with pytest.raises(ConfigError, match="'residency.exact_budget' = -1 should be at least 0"):
        EngineConfig.from_dict({"residency": {"miss_policy": "auto", "exact_budget": -1}})


# -- the demo model, half resident ----------------------------------------------------------------


@pytest.fixture(scope="module")
def demo():
    """The demo model (MXFP4 experts) half resident under `auto`, loaded with every MoE layer's
    routing sent to `seen` by a callback: (engine, seen). The interceptor is active while the
    calibration prefill traces the score step, so later calls of that shape report too."""
    seen = []

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if isinstance(module, MoE) and context.method_name == "__call__":
            x, mask, experts = args[:3]
            bias = module.get_variable("params", "gate_bias") if module.router.use_bias else None
            ids, weights, _ = route(x.reshape(-1, x.shape[-1]),
                                    module.get_variable("params", "gate_weight"), bias,
                                    module.router)
            jax.debug.callback(lambda *a: seen.append(tuple(map(np.asarray, a))),
                               module.moe_index, ids, weights,
                               experts.rowmap[module.moe_index], mask.reshape(-1))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        engine = tidejax.load(REPO / "models" / "demo", model={"experts": "mxfp4"},
                              engine={"max_context": 64, "prefill_chunk": 16, "lanes": 1},
                              residency={"budget_experts": 72, "miss_policy": "auto",
                                         "adapt": False})
    return engine, seen


def test_approximate_share_is_the_routers_own_count(demo):
    engine, seen = demo
    res = engine.residency
    threshold = res.exact_weight
    prompt = engine.tokenizer.encode("Once upon a time, the fox")[:16]  # the calibration's shape
    seen.clear()
    approx0, routed0 = res.approx_tally()
    picks0, misses0 = res.cpu_picks(), res.counters["misses"]
    engine.logits(prompt)
    n_moe = engine.family.expert_dims(engine.cfg)[0]
    assert sorted(int(s[0]) for s in seen) == list(range(n_moe))  # every MoE layer reported
    want_approx, want_host = 0.0, 0
    for _, ids, weights, rowmap, mask in seen:
        shares = np.asarray(weights, np.float64) / np.asarray(weights, np.float64).sum(
            -1, keepdims=True)
        miss = mask[:, None] & (rowmap[ids] < 0)
        light = miss & (shares < threshold)
        want_approx += shares[light].sum()
        want_host += int((miss & ~light).sum())
    approx, routed = res.approx_tally()
    assert routed - routed0 == len(prompt) * n_moe
    assert want_approx > 0 and want_host > 0  # both kinds of miss served
    np.testing.assert_allclose(approx - approx0, want_approx, rtol=1e-5)
    assert res.cpu_picks() - picks0 == want_host
    assert res.counters["misses"] - misses0 > want_host
    share = (approx - approx0) / (routed - routed0)
    assert 0 < share < 1 and res.stats()["approx_weight_share_step"] == pytest.approx(share)


def test_weight_shares_undo_the_scaling():
    w = jnp.asarray([[1.5, 0.75, 0.75], [0.0, 0.0, 0.0]], jnp.float32)
    np.testing.assert_allclose(np.asarray(weight_shares(w)), [[0.5, 0.25, 0.25], [0, 0, 0]])


def test_server_reports_the_approximate_share(demo):
    engine, _ = demo
    client = LocalEngineClient(engine)
    client.scheduler.start()  # as client.start(), less the warm-up: the request compiles its two
    # step shapes, not all four (the test's time)
    server = Server(EngineConfig().with_overrides({"model": {"path": str(REPO / "models" /
                                                                         "demo")}}))
    server.attach(client)
    try:
        with serve_app(server) as url:
            oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            done = oai.completions.create(model=engine.served_name, prompt="The tide came in",
                                          max_tokens=8, temperature=0)
    finally:
        client.stop()
    stats = done.model_extra["x_engine_stats"]
    assert 0 < stats["approx_weight_share"] < 1
    assert stats["cpu_picks"] > 0
