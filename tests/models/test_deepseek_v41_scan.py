"""DeepSeek-V4.1's scanned layer runs: the engine (runs scanned, their params stacked at load)
against the unrolled forward (every layer its own, the path the goldens check), on a 9-layer
ds41-tiny synthetic whose layers 3 and 4 are one run (two ratio-2 layers reusing layer 2's
group)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import tidejax
from tidejax.models.deepseek_v41.model import DeepseekV41
from tidejax.models.deepseek_v41.weights import load
from tidejax.residency.history import History
from tidejax.residency.serve import ServeOptions
from tidejax.residency.trace import read_trace
from tests.support.v41_runner import new_cache
from tools import make_synthetic


def test_engine_scans_the_runs_and_equals_the_unrolled_forward(tmp_path):
    make_synthetic.main([str(tmp_path), "--shape", "ds41-tiny", "--layers", "9"])
    ck = load(tmp_path)
    assert ck.cfg.layer_runs() == ((3, 1, 2),)
    engine = tidejax.load(tmp_path, engine={"lanes": 1, "max_context": 64, "scan_layers": True})
    run = engine.loaded.params["layers_3_4"]["layer_0"]  # what the scan steps over
    assert "layers_3" not in engine.loaded.params and run["attn"]["wq_a"]["weight"].shape[0] == 2
    np.testing.assert_array_equal(run["attn_norm"]["weight"][1],
                                  ck.params["params"]["layers_4"]["attn_norm"]["weight"])

    ids = np.random.default_rng(0).integers(0, 4000, 16).astype(np.int32)
    pos = jnp.arange(len(ids), dtype=jnp.int32)[None]
    unrolled = DeepseekV41(ck.cfg, ServeOptions(swiglu_limit=ck.cfg.swiglu_limit,
                                                all_resident=True))
    want, _, _ = jax.jit(lambda params, cache, table, engram, experts: unrolled.apply(
        params, jnp.asarray(ids)[None], pos, pos >= 0, cache, table, experts, engram))(
        ck.params, *new_cache(ck.cfg, 1, len(ids)), ck.engram, ck.experts)
    got = engine.logits(ids)
    assert np.abs(got - np.asarray(want[0])).max() <= 1e-4

    # half resident, "exact": the scanned layers fetch their misses by their traced MoE rows,
    # and record their picks in the routing trace by them (drain_every 1 and no decay: the
    # saved history is every step's counts)
    n_layers, n_experts = engine.family.expert_dims(engine.cfg)[:2]
    state_dir = tmp_path / "state"
    half = tidejax.load(tmp_path, engine={"lanes": 1, "max_context": 64, "scan_layers": True},
                        residency={"budget_experts": n_layers * n_experts // 2,
                                   "miss_policy": "exact", "drain_every": 1, "half_life": 1e9,
                                   "state_dir": str(state_dir), "trace_every_steps": 1})
    np.testing.assert_array_equal(half.logits(ids), got)
    assert half.residency.stats()["misses"] > 0
    half.generate("The tide comes in", max_new_tokens=3)
    half.close()
    _, trace = read_trace(state_dir / "routing")
    counts = History.read(state_dir / "history.npz").counts  # [MoE layers, E]
    for layer in range(n_layers):
        np.testing.assert_allclose(np.bincount(trace["ids"][:, layer].reshape(-1),
                                               minlength=n_experts), counts[layer], rtol=1e-6)
