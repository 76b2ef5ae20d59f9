"""The MTP layer's routed experts through residency (issue 33): speculating, the drafting MTP
layer is one more MoE layer of the residency geometry, after the main model's. On a tiny
DeepSeek-V3 whose MTP layer drafts well (tiny_models.repeating_mtp), with a bank of half the
experts: greedy output equal to the all-resident engine's without speculation and to the
budgeted one's without; the MTP layer's experts not all on the device, swapped and missed and
served, its demand in the saved history, the verify steps' picks counted; a history or seed
map saved with speculation off migrated or refused; the MTP layer's rows on the disk tier."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tidejax
from tidejax.errors import ConfigError
from tidejax.models.layers.mtp import MtpExpertRows
from tidejax.residency.history import History
from tidejax.runtime.scheduler import GenerationRequest
from tests.support.engine_probes import run, tokens_of

K = 2
ENGINE = {"lanes": 2, "max_context": 48, "page_size": 8, "prefill_chunk": 16, "warmup": False}
PROMPTS = [np.random.RandomState(s).randint(3, 256, n).tolist() for s, n in ((1, 14), (2, 9))]
NEW = 16


@pytest.fixture(scope="module")
def all_resident(v3_mtp):
    """The engine without speculation, every expert resident: (its greedy output, config)."""
    plain = tidejax.load(v3_mtp, engine=ENGINE)
    out = greedy(plain), plain.loaded.cfg
    plain.close()
    return out


def budgeted(layers: int, experts: int, state_dir, policy: str) -> dict:
    """Half the experts of every layer in the bank, misses served by `policy`, a drain every 2
    steps, no decay to speak of (the history's counts are the picks counted)."""
    return {"budget_experts": layers * experts // 2, "miss_policy": policy, "drain_every": 2,
            "hysteresis": 1.0, "half_life": 1e12, "state_dir": str(state_dir)}


def greedy(engine) -> list[list[int]]:
    return greedy_with_stats(engine)[0]


def greedy_with_stats(engine) -> tuple[list[list[int]], list[dict]]:
    events = run(engine, [GenerationRequest(p, NEW, ignore_eos=True) for p in PROMPTS])
    return [tokens_of(got) for got in events], [got[-1].stats for got in events]


@pytest.mark.parametrize("policy", ["exact", "cpu"])
def test_mtp_experts_served_and_counted_by_residency(v3_mtp, all_resident, tmp_path, policy):
    """Speculating with half the experts in the bank: the residency geometry has the MTP layer
    after the main MoE layers, the bank holds only some of its experts (the draft params none),
    the greedy output is the all-resident plain engine's and the budgeted plain engine's, the
    MTP layer's experts were missed and served (by `policy`, exact either way) and swapped in
    by the planner, and its demand is in the saved history, which says it has one MTP layer.
    The verify steps' picks are counted too: every main MoE layer's picks in the history are
    top_k for each token the steps routed (residency's `wanted`, which counts a verify step's
    k + 1 positions a lane), one MoE layer's share of it."""
    want, cfg = all_resident
    n_moe, n_experts = len(cfg.moe_layers), cfg.n_routed_experts
    off = tidejax.load(v3_mtp, engine=ENGINE,
                       residency=budgeted(n_moe, n_experts, tmp_path / "off", policy))
    assert greedy(off) == want
    off.close()

    engine = tidejax.load(v3_mtp, engine=ENGINE, speculative={"method": "mtp", "tokens": K},
                          residency=budgeted(n_moe + 1, n_experts, tmp_path / "on", policy))
    residency = engine.loaded.residency
    assert (residency.n_layers, residency.mtp_layers) == (n_moe + 1, 1)
    # memory: the bank's resident slots hold half the MTP layer's experts; the draft's params
    # hold no routed expert
    mtp_rows = range(n_moe * n_experts, (n_moe + 1) * n_experts)
    boot = residency.slot_rows[:residency.n_resident].copy()
    assert np.isin(boot, mtp_rows).sum() == n_experts // 2
    assert residency.n_resident + residency.n_transient < (n_moe + 1) * n_experts
    assert "experts" not in engine.loaded.step_params[1][f"layers_{cfg.num_layers}"]["moe"]

    got, stats = greedy_with_stats(engine)
    assert got == want
    assert all(s["drafted_tokens"] > 0 for s in stats)  # verify steps judged drafts
    assert residency.misses_by_layer[-1] > 0  # the MTP layer's misses, served by the policy
    if policy == "cpu":
        assert residency.cpu_picks() > 0
    now = residency.slot_rows[:residency.n_resident]
    swapped_in = set(now[np.isin(now, mtp_rows)]) - set(boot[np.isin(boot, mtp_rows)])
    print(f"MTP layer: {residency.misses_by_layer[-1]} misses served, "
          f"{len(swapped_in)} experts swapped in; misses by layer {residency.misses_by_layer}")
    assert swapped_in, "the planner swapped none of the MTP layer's experts in"
    engine.close()
    saved = History.read(tmp_path / "on" / "history.npz")
    assert saved.shape == (n_moe + 1, n_experts) and saved.mtp_layers == 1
    assert saved.counts[-1].sum() > 0 and saved.weights[-1].sum() > 0
    per_layer = residency.counters["wanted"] / (n_moe + 1)  # [L_moe + 1] layers' share
    np.testing.assert_allclose(saved.counts[:-1].sum(axis=1), per_layer, rtol=1e-6)


def test_history_migrates_when_speculation_turns_on_and_off(v3_mtp, tmp_path):
    """A history saved without speculation resumes speculating with its main layers' demand and
    the MTP layer's at zero; saved speculating, it resumes without with the MTP layer dropped.
    A seed map fitted without speculation is refused speculating, naming 'mtp_layers'."""
    state = tmp_path / "state"
    cfg_raw = json.loads((v3_mtp / "config.json").read_text())
    n_experts = cfg_raw["n_routed_experts"]
    n_moe = cfg_raw["num_hidden_layers"] - cfg_raw["first_k_dense_replace"]
    saved = History(n_moe, n_experts)
    saved.add(np.arange(n_moe * n_experts).reshape(n_moe, n_experts),
              np.ones((n_moe, n_experts)), 10)
    saved.save(state / "history.npz")
    on = History.resume(state / "history.npz", n_moe + 1, n_experts, 500.0, mtp_layers=1)
    assert on.shape == (n_moe + 1, n_experts) and on.mtp_layers == 1 and on.steps == 10
    np.testing.assert_array_equal(on.counts[:-1], saved.counts)
    assert not on.counts[-1].any() and not on.weights[-1].any()
    on.counts[-1] = 5
    on.save(state / "history.npz")
    back = History.resume(state / "history.npz", n_moe, n_experts, 500.0)
    assert back.shape == (n_moe, n_experts) and back.mtp_layers == 0
    np.testing.assert_array_equal(back.counts, saved.counts)
    # a history of other main layers is still set aside, not misread
    assert History.resume(state / "history.npz", n_moe + 2, n_experts, 500.0, 1) is None

    seed = {"format": "tidejax-seed-map/1", "geometry": "per_layer", "n_layers": n_moe,
            "n_experts": n_experts, "budget": n_moe, "rows": [l * n_experts for l in range(n_moe)]}
    (tmp_path / "seed.json").write_text(json.dumps(seed))
    with pytest.raises(ConfigError, match="mtp_layers"):
        tidejax.load(v3_mtp, engine=ENGINE, speculative={"method": "mtp", "tokens": K},
                     residency={"budget_experts": n_moe + 1,
                                "seed_map": str(tmp_path / "seed.json")})


def test_mtp_experts_read_from_the_disk_tier(v3_mtp, tmp_path):
    """A host budget of half the rows (the disk tier), experts held in bf16 (so prepared
    copies): speculating, the MTP layer's rows follow the main model's on disk, in a prepared
    copy of their own beside the main model's, which the speculating engine reuses as written
    without speculation; the greedy output is the one without speculation on the same tier, and
    MTP-layer rows were read from disk. The MTP rows map the checkpoint's file (a change of it
    is refused before a read)."""
    residency = {"budget_experts": 8, "host_budget_experts": 12, "miss_policy": "exact",
                 "state_dir": str(tmp_path)}
    model = {"experts": "bf16"}
    off = tidejax.load(v3_mtp, engine=ENGINE, model=model, residency=residency)
    want = greedy(off)
    main_copy = off.residency.disk_rows.path
    written = main_copy.stat()
    off.close()

    engine = tidejax.load(v3_mtp, engine=ENGINE, model=model, residency=residency,
                          speculative={"method": "mtp", "tokens": K})
    rows, cfg = engine.residency.disk_rows, engine.loaded.cfg
    n_main = len(cfg.moe_layers) * cfg.n_routed_experts
    assert rows.n_first == n_main and rows.layout["down"].shape[0] == n_main + cfg.n_routed_experts
    assert rows.first.path == main_copy and main_copy.stat().st_mtime_ns == written.st_mtime_ns
    assert rows.then.path.name == main_copy.stem + "-mtp.rows"
    assert engine.residency.host_capacity < rows.layout["down"].shape[0]
    got, stats = greedy_with_stats(engine)
    assert got == want
    assert all(s["accepted_tokens"] > 0 for s in stats)
    reads = engine.residency.cache.reads_by_row
    print(f"disk reads: main rows {reads[:n_main].sum()}, MTP rows {reads[n_main:].sum()}")
    assert reads[n_main:].sum() > 0 and reads.sum() == engine.residency.stats()["disk_reads"]
    mapped = MtpExpertRows(engine.loaded._aux, cfg, np.float32)
    assert mapped.files() == [v3_mtp / "model.safetensors"] and not mapped.read_direct()
    engine.close()


def test_mtp_experts_join_mxfp4_rows_on_the_disk_tier(tmp_path):
    """A checkpoint whose main experts are stored MXFP4 and whose MTP layer's are per-expert BF16
    (as published; make_synthetic --mtp-layers), its rows held as stored with half of them on
    disk: the MTP rows are quantized to the main rows' MXFP4 layout to join them (refused at
    load before), MTP-layer rows are read from disk, and the greedy output is the one without
    speculation with every expert in host memory."""
    from tools import make_synthetic

    model = tmp_path / "mtp"
    assert make_synthetic.main([str(model), "--tiny", "--mtp-layers", "1", "--workers", "1"]) == 0
    plain = tidejax.load(str(model), engine=ENGINE)
    want = greedy(plain)
    plain.close()
    engine = tidejax.load(str(model), engine=ENGINE, speculative={"method": "mtp", "tokens": K},
                          residency={"budget_experts": 8, "host_budget_experts": 12,
                                     "miss_policy": "exact", "state_dir": str(tmp_path / "s")})
    try:
        rows, cfg = engine.residency.disk_rows, engine.loaded.cfg
        n_main = len(cfg.moe_layers) * cfg.n_routed_experts
        assert rows.n_first == n_main and set(rows.then.layout) == set(rows.first.layout)
        assert "gate_up_blocks" in rows.then.layout
        got, stats = greedy_with_stats(engine)
        assert got == want
        assert all(s["drafted_tokens"] > 0 for s in stats)
        reads = engine.residency.cache.reads_by_row
        assert reads[n_main:].sum() > 0
    finally:
        engine.close()
