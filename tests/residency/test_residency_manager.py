"""The residency manager: planner, history persistence, seed maps, adaptation on a toy workload."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.residency_fixtures import (E, L, make_pool, make_router, tokens, toy_batch_step,
                                              toy_step)
from tidejax.config import ResidencySection
from tidejax.errors import ConfigError
from tidejax.residency import Residency
from tidejax.residency.__main__ import main as residency_cli
from tidejax.residency.history import History
from tidejax.residency.planner import Swap, fit_rows, place, plan
from tidejax.residency.pool import budget_slots


def test_planner_hysteresis_boundary():
    demand = np.array([[10.0, 4.0, 5.99, 1.0]])  # one layer; experts 0, 1 resident
    resident = np.array([0, 1])
    assert plan(demand, resident, "per_layer") == []  # 5.99 < 1.5 x 4
    demand[0, 2] = 6.0
    assert plan(demand, resident, "per_layer") == [Swap(slot=1, row=2)]
    assert plan(demand, resident, "per_layer", hysteresis=2.0) == []
    demand[0, 3] = 16.0  # the busiest cold expert replaces the idlest resident; 6 < 1.5 x 10 stays
    assert plan(demand, resident, "per_layer") == [Swap(slot=1, row=3)]
    demand[0, 2] = 15.0  # now 15 >= 1.5 x 10 too
    assert plan(demand, resident, "per_layer") == [Swap(slot=1, row=3), Swap(slot=0, row=2)]


def test_planner_caps_per_layer_and_empty_slots():
    demand = np.zeros((2, 8))
    demand[0, :4] = 1.0
    demand[0, 4:] = 100.0  # layer 0: four hot cold experts
    demand[1, 5] = 3.0
    resident = np.array([0, 1, 2, 3, 8, 9, 10, -1])  # 4 slots a layer; layer 1 has an empty slot
    swaps = plan(demand, resident, "per_layer", max_per_layer=2)
    assert [s.row for s in swaps if s.row < 8] == [4, 5]  # capped at 2 for layer 0
    assert [(s.slot, s.row) for s in swaps if s.row >= 8] == [(7, 13)]  # the empty slot first


def test_planner_arena_moves_slots_between_layers():
    demand = np.zeros((2, 4))
    demand[0] = [9, 8, 7, 6]  # busy layer
    demand[1] = [1, 0.5, 0, 0]  # quiet layer
    resident = np.array([0, 4, 5, 6])  # layer 0 holds one slot, layer 1 three
    swaps = plan(demand, resident, "arena", max_per_layer=2)
    assert len(swaps) == 2  # layer 1 gives up 2 slots (its cap), layer 0 takes 2
    assert sorted(s.row for s in swaps) == [1, 2]
    assert sorted(s.slot for s in swaps) == [2, 3]  # the idlest residents (rows 5, 6)


def test_budget_slots():
    assert budget_slots(0, 0.0, 100, 50) == 50
    assert budget_slots(7, 0.0, 100, 50) == 7
    assert budget_slots(0, 1.0, 2**28, 50) == 4
    with pytest.raises(ConfigError, match="not both"):
        budget_slots(3, 1.0, 100, 50)
    with pytest.raises(ConfigError, match="holds no expert"):
        budget_slots(0, 1e-9, 2**20, 50)


def section(tmp_path, **kw):
    base = dict(budget_experts=L * E // 2, miss_policy="substitute", drain_every=4,
                half_life=8.0, state_dir=str(tmp_path / "state"))
    return ResidencySection(**{**base, **kw})


def manager(tmp_path, **kw):
    """A Residency and its boot state (the caller owns the state, as the scheduler does)."""
    res = Residency(make_pool(), L, 2, section(tmp_path, **kw), kernel="reference", max_tokens=4)
    return res, res.take_state()


ROUTER = jnp.asarray(make_router())
NO_BIAS = jnp.zeros(E, jnp.float32)


def domain(hot):
    """A router bias that favours experts `hot` in every layer."""
    return jnp.asarray(np.where(np.isin(np.arange(E), hot), 6.0, 0.0), jnp.float32)


def serve_steps(res, state, bias, n, seed=0):
    """n toy steps, each applying the manager's next batch; (the cold share of each step, the
    state)."""
    shares = []
    for i in range(n):
        _, state, tallies = toy_batch_step(state, res.next_batch(), tokens(seed + i),
                                           jnp.ones(4, bool), ROUTER, bias, res.options)
        res.after_step(tallies, tokens=4)
        shares.append(res.stats()["cold_share_step"])
    return shares, state


def test_stale_swap_rejected(tmp_path):
    res, state = manager(tmp_path)
    planned_on = res.version
    state = res.apply_swaps(state, [Swap(slot=0, row=5, version=planned_on)])  # moves slot 0
    assert res.stats()["swaps_applied"] == 1
    before = np.asarray(state.slot_rows).copy()
    state = res.apply_swaps(state, [Swap(slot=0, row=6, version=planned_on),  # stale: slot moved
                                    Swap(slot=1, row=7, version=planned_on)])  # still valid
    assert res.stats()["swaps_rejected"] == 1 and res.stats()["swaps_applied"] == 2
    after = np.asarray(state.slot_rows)
    assert after[0] == before[0] == 5 and after[1] == 7
    np.testing.assert_array_equal(after, res.slot_rows)


def test_miss_tally_lags_one_step_and_flush_completes_it(tmp_path):
    """after_step reads a step's misses at the next step (it never waits for the device); flush
    reads the rest: then the totals are every wanted pick of a non-resident expert."""
    res, state = manager(tmp_path, adapt=False, drain_every=1000)  # a fixed resident set
    wanted = []
    for i in range(5):
        _, state, tallies = toy_batch_step(state, res.next_batch(), tokens(i), jnp.ones(4, bool),
                                           ROUTER, NO_BIAS, res.options)
        res.after_step(tallies, tokens=4)
        wanted.append(res.stats()["wanted"])
    assert wanted == [0, 1 * 4 * 2 * L, 2 * 4 * 2 * L, 3 * 4 * 2 * L, 4 * 4 * 2 * L]
    res.flush()
    s = res.stats()
    resident = res.slot_rows[:res.n_resident]
    cold = ~np.isin(np.arange(L * E), resident)
    assert s["wanted"] == 5 * 4 * 2 * L
    assert s["misses"] == np.asarray(state.counts).reshape(-1)[cold].sum() > 0
    assert s["window_steps"] == 5


def test_domain_shift_adapts_and_seed_map_starts_low(tmp_path):
    res, state = manager(tmp_path)  # boots on experts 0..3 of each layer (no map, no history)
    assert res.needs_calibration
    _, state = serve_steps(res, state, domain([4, 5, 6, 7]), 40)  # domain A: adapt to it
    shares, state = serve_steps(res, state, domain([0, 2, 5, 7]), 40, seed=100)  # shift to B
    res.flush()  # the last step's drain (after_step reads it at the next step)
    s = res.stats()
    peak, last = max(shares[:8]), np.mean(shares[-8:])
    assert peak > 0.3 and last < peak / 4, (peak, last)
    assert s["swaps_applied"] > 0 and s["bytes_moved"] == s["swaps_applied"] * res.row_bytes
    assert s["swaps_applied"] <= s["drains"] * 2 * L  # the per-layer cap held
    lines = (tmp_path / "state" / "telemetry.jsonl").read_text().splitlines()
    assert len(lines) == s["drains"] and json.loads(lines[-1])["steps"] == 80

    # a seed map fitted on that history boots low on domain B, with adaptation off
    seed_path = tmp_path / "seed.json"
    assert residency_cli(["fit", "--history", str(tmp_path / "state" / "history.npz"),
                          "--budget", str(L * E // 2), "--out", str(seed_path)]) == 0
    cold_boot = manager(tmp_path / "cold", adapt=False)
    seeded = manager(tmp_path / "seeded", adapt=False, seed_map=str(seed_path))
    cold_shares, _ = serve_steps(*cold_boot, domain([0, 2, 5, 7]), 8, seed=300)
    seed_shares, _ = serve_steps(*seeded, domain([0, 2, 5, 7]), 8, seed=300)
    assert np.mean(seed_shares) < np.mean(cold_shares) / 2, (seed_shares, cold_shares)
    assert seeded[0].stats()["swaps_applied"] == 0


def test_freeze_keeps_counting_and_boot_resumes_history(tmp_path):
    res, state = manager(tmp_path)
    res.freeze()
    _, state = serve_steps(res, state, domain([4, 5, 6, 7]), 8)
    res.flush()
    s = res.stats()
    assert s["swaps_applied"] == 0 and s["drains"] == 2 and s["frozen"]
    assert res.history.counts.sum() > 0 and s["misses"] > 0
    res.unfreeze()
    serve_steps(res, state, domain([4, 5, 6, 7]), 8)
    assert res.stats()["swaps_applied"] > 0
    res.save()
    # a new boot resumes the saved history and starts from its busiest experts
    again, again_state = manager(tmp_path)
    assert not again.needs_calibration and again.history.steps == res.history.steps
    hot = np.asarray(again_state.slot_rows).reshape(L, -1) % E
    assert (np.isin(hot, [4, 5, 6, 7]).sum(axis=1) >= 3).all()


def test_reseed_after_calibration(tmp_path):
    res, state = manager(tmp_path, state_dir="")
    assert res.needs_calibration
    for i in range(2):  # a 'calibration prefill': count only
        _, state = toy_step(state, tokens(i), jnp.ones(4, bool), ROUTER, domain([4, 5, 6, 7]),
                            res.options)
    state = res.reseed(state)
    assert not res.needs_calibration
    resident = np.asarray(state.slot_rows)[:res.n_resident]
    # the calibration's heaviest experts by routing weight, most of them the domain's
    assert sorted(resident) == sorted(fit_rows(res.history.demand, res.n_resident, "per_layer"))
    assert np.isin(resident % E, [4, 5, 6, 7]).sum() >= 2 * L


def test_ring_copies_heavy_misses(tmp_path):
    """A step's misses are fetched by the next step and written at the start of the one after,
    which routes to them (ring hits), as the step tallies say."""
    res, state = manager(tmp_path, miss_policy="ring", ring_slots=2, adapt=True)
    _, state = serve_steps(res, state, domain([4, 5, 6, 7]), 5)
    res.flush()
    s = res.stats()
    assert s["ring_copies"] > 0 and s["ring_hits"] > 0
    assert s["bytes_moved"] >= s["ring_copies"] * res.row_bytes
    ring = np.asarray(state.slot_rows)[res.n_resident:]
    assert (ring >= 0).all() and np.isin(ring % E, [4, 5, 6, 7]).all()


def test_corrupt_history_is_set_aside(tmp_path, caplog):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "history.npz").write_bytes(b"not a history")
    res, _ = manager(tmp_path)
    assert res.history.steps == 0
    assert not (state_dir / "history.npz").exists()
    assert list(state_dir.glob("history.npz.corrupt-*"))
    assert "set aside" in caplog.text


WRITER = """
import sys
import numpy as np
from tidejax.residency.history import History
h = History(61, 384)
i = 0
while True:
    i += 1
    h.counts[:] = i; h.weights[:] = 2 * i; h.steps = i
    h.save(sys.argv[1])
"""


def test_history_survives_kill_mid_write(tmp_path):
    path = tmp_path / "history.npz"
    rng = np.random.default_rng(0)
    seen = []
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])
        deadline = time.time() + 60
        while not path.exists() and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        h = History.read(path)  # the last good copy, whole
        assert (h.counts == h.steps).all() and (h.weights == 2 * h.steps).all()
        seen.append(h.steps)
    assert max(seen) > 1
    resumed = History.resume(path, 61, 384, 500.0)  # clears torn temporary files
    assert resumed is not None and not list(tmp_path.glob(".history.npz.*.tmp"))


def test_fit_cli_errors_name_the_file(tmp_path, capsys):
    bad = tmp_path / "h.npz"
    bad.write_bytes(b"junk")
    assert residency_cli(["fit", "--history", str(bad), "--budget", "4", "--out",
                          str(tmp_path / "m.json")]) == 2
    assert str(bad) in capsys.readouterr().err
    cli = subprocess.run([sys.executable, "-m", "tidejax.residency", "fit", "--history", str(bad),
                          "--budget", "4", "--out", str(tmp_path / "m.json")],
                         capture_output=True, text=True)
    assert cli.returncode == 2 and str(bad) in cli.stderr


def test_plan_applied_at_most_max_swaps_per_step(tmp_path):
    res, state = manager(tmp_path, max_swaps_per_step=4, max_swaps_per_layer=2, drain_every=100)
    res.history.weights[:, 4:] = 50.0  # every layer wants experts 4..7; 0..3 are resident
    state = res.drain(state)
    assert res.stats()["swaps_queued"] == 2 * L  # the per-layer cap
    applied = []
    for i in range(3):
        _, state = serve_steps(res, state, NO_BIAS, 1, seed=i)
        applied.append(res.stats()["swaps_applied"])
    assert applied == [4, 6, 6]
    np.testing.assert_array_equal(np.asarray(state.slot_rows), res.slot_rows)


def test_manager_swap_campaign_then_restore(tmp_path):
    res, state = manager(tmp_path, miss_policy="exact", adapt=False)
    x = tokens(7)
    options = res.options
    before, state = toy_step(state, x, jnp.ones(4, bool), ROUTER, NO_BIAS, options)
    rng = np.random.default_rng(1)
    for _ in range(200):
        cold = np.setdiff1d(np.arange(L * E), res.slot_rows[:res.n_resident])
        layer_slot = rng.integers(res.n_resident)
        layer = layer_slot // (res.n_resident // L)
        row = rng.choice(cold[cold // E == layer])
        state = res.apply_swaps(state, [Swap(int(layer_slot), int(row), res.version)])
    assert res.stats()["swaps_applied"] == 200 and res.stats()["swaps_rejected"] == 0
    np.testing.assert_array_equal(np.asarray(state.slot_rows), res.slot_rows)
    state = res.move_to(state, res.boot_rows)
    assert sorted(res.slot_rows[:res.n_resident]) == sorted(res.boot_rows[:res.n_resident])
    after, state = toy_step(state, x, jnp.ones(4, bool), ROUTER, NO_BIAS, options)
    np.testing.assert_array_equal(np.asarray(after), np.asarray(before))


def test_place_keeps_the_busiest_rows_each_group_can_hold():
    # per_layer, 2 layers of 4 experts, 2 slots a layer; layer 0 asks for 3 rows (keeps the first 2)
    slot_rows = place(np.array([2, 0, 3, 5]), 4, 2, 4, "per_layer")
    np.testing.assert_array_equal(slot_rows, [2, 0, 5, 4])  # layer 1 filled with its lowest free row
    np.testing.assert_array_equal(place(np.array([7, 6, 1]), 2, 2, 4, "arena"), [7, 6])
    with pytest.raises(ValueError, match="rows must be in"):
        place(np.array([8]), 2, 2, 4, "arena")


def test_arena_follows_a_skewed_domain(tmp_path):
    res, state = manager(tmp_path, geometry="arena")
    shares, _ = serve_steps(res, state, domain([4, 5, 6, 7]), 24)
    assert np.mean(shares[-4:]) < np.mean(shares[:4]) / 2, shares
    rows = res.slot_rows[:res.n_resident]
    assert np.isin(rows % E, [4, 5, 6, 7]).mean() > 0.8


def test_stats_resume_after_a_restart(tmp_path):
    res, state = manager(tmp_path, hysteresis=1.0)
    _, state = serve_steps(res, state, domain([4, 5, 6, 7]), 9)
    res.flush()
    res.save()
    saved = res.stats()
    assert saved["steps"] == 9 and saved["misses"] > 0 and saved["swaps_applied"] > 0
    assert saved["hits"] == saved["wanted"] - saved["misses"] > 0
    again, again_state = manager(tmp_path)
    counted = ("steps", "misses", "hits", "wanted", "swaps_applied", "swaps_planned", "drains",
               "bytes_moved")
    assert {k: again.stats()[k] for k in counted} == {k: saved[k] for k in counted}
    serve_steps(again, again_state, domain([4, 5, 6, 7]), 4)
    assert again.stats()["steps"] == 13  # on from the saved count


def test_a_bad_or_missing_stats_file_is_one_warning_and_a_fresh_start(tmp_path, caplog):
    res, state = manager(tmp_path)
    serve_steps(res, state, NO_BIAS, 4)
    res.flush()  # the drain read: the history and stats.json saved
    stats = tmp_path / "state" / "stats.json"
    for content, problem in [(None, "stats.json is missing"),
                             (b"{torn", "not a residency stats file (JSONDecodeError"),
                             (b'{"format": "other/1", "counters": {}}', "format 'other/1'"),
                             (json.dumps({"format": "tidejax-residency-stats/1",
                                          "counters": {"steps": -3}}).encode(),
                              "'counters.steps' = -3 is not a count")]:
        stats.unlink(missing_ok=True)
        if content is not None:
            stats.write_bytes(content)
        caplog.clear()
        again, _ = manager(tmp_path)
        assert again.stats()["steps"] == 0
        [warning] = [r for r in caplog.records if r.levelname == "WARNING"]
        assert problem in warning.getMessage() and str(stats) in warning.getMessage()
        assert "\n" not in warning.getMessage()
        assert content is None or list(stats.parent.glob("stats.json.corrupt-*"))


def test_a_failed_save_is_logged_once_a_streak_and_retried(tmp_path, caplog):
    """A drain's save that fails (here: a file where the state dir should be) never raises; one
    warning a streak of failures, each drain retries, and a save that works again says so."""
    caplog.set_level(logging.INFO, logger="tidejax.residency")
    blocker = tmp_path / "state"
    blocker.write_text("not a directory")
    res, state = manager(tmp_path, drain_every=2)

    def warnings():
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]

    _, state = serve_steps(res, state, NO_BIAS, 8)
    assert res.save_failing and res.stats()["save_failures"] == 3  # drains at 2, 4, 6
    [warning] = warnings()
    assert "could not save" in warning and str(blocker) in warning
    blocker.unlink()
    _, state = serve_steps(res, state, NO_BIAS, 2)
    assert not res.save_failing and (blocker / "history.npz").exists()
    assert "saved under" in caplog.text and len(warnings()) == 1
    for f in blocker.iterdir():
        f.unlink()
    blocker.rmdir()
    blocker.write_text("again")
    serve_steps(res, state, NO_BIAS, 4)
    assert len(warnings()) == 2 and res.stats()["save_failures"] == 5


def test_rebuild_follows_the_host_map(tmp_path):
    """After a failed step, the expert state is rebuilt from the pool and the host map: its
    resident slots hold what the map says (swaps handed out included), the device's ring is
    emptied with nothing left to copy, the counters start at zero."""
    res, state = manager(tmp_path, miss_policy="ring", ring_slots=2)
    _, state = serve_steps(res, state, domain([4, 5, 6, 7]), 3)
    assert (np.asarray(state.slot_rows)[res.n_resident:res.n_resident + 2] >= 0).all()
    cold = next(r for r in range(E) if r not in res.slot_rows[:res.n_resident])  # layer 0's
    res._queue = [Swap(slot=0, row=cold, version=res.version)]
    batch = res.next_batch()  # handed to a step that then fails: the map holds its swap already
    assert int(batch.count) == 1 and res.slot_rows[0] == cold
    rebuilt = res.rebuild(state.rows)
    np.testing.assert_array_equal(np.asarray(rebuilt.slot_rows), res.slot_rows)
    assert (res.slot_rows[res.n_resident:] == -1).all() and res.stats()["rebuilds"] == 1
    assert (np.asarray(rebuilt.ring_rows) == -1).all()
    pool = make_pool()
    for slot, row in enumerate(res.slot_rows[:res.n_resident]):
        if row >= 0:
            np.testing.assert_array_equal(np.asarray(rebuilt.bank["down"][slot]), pool["down"][row])
    rowmap = np.asarray(rebuilt.rowmap).reshape(-1)
    assert all(rowmap[row] == slot for slot, row in enumerate(res.slot_rows) if row >= 0)
    assert not np.asarray(rebuilt.counts).any()
    serve_steps(res, rebuilt, domain([4, 5, 6, 7]), 2)  # and serves on


def test_the_planner_follows_routing_weight_not_counts(tmp_path):
    """Expert 4 is picked often and lightly, expert 5 seldom and heavily: the 1.5x rule compares
    routing weight, so 5 comes in and 4 does not (by counts it would be the other way)."""
    res, state = manager(tmp_path, drain_every=100, max_swaps_per_layer=2)
    assert (res.slot_rows[:res.n_resident].reshape(L, -1) % E == np.arange(4)).all()
    res.history.counts[:, :4], res.history.weights[:, :4] = 50.0, 4.0  # the resident ones
    res.history.counts[:, 4], res.history.weights[:, 4] = 100.0, 5.0  # < 1.5 x 4
    res.history.counts[:, 5], res.history.weights[:, 5] = 10.0, 8.0  # >= 1.5 x 4
    res.drain(state)
    assert sorted(s.row % E for s in res._queue) == [5] * L


def test_seed_fit_follows_routing_weight(tmp_path, capsys):
    history = History(2, 4)
    history.add([[9, 1, 1, 0], [0, 9, 1, 1]], [[0.5, 3.0, 2.0, 0.0], [0.0, 0.1, 1.0, 2.0]], 10)
    history.save(tmp_path / "history.npz")
    out = tmp_path / "seed.json"
    assert residency_cli(["fit", "--history", str(tmp_path / "history.npz"), "--budget", "4",
                          "--out", str(out)]) == 0
    assert json.loads(out.read_text())["rows"] == [1, 2, 7, 6]  # by weight, busiest first
    assert "covering 93.0% of the history's demand" in capsys.readouterr().out


def old_history(path, counts, weights=None):
    """A history as a count-only writer saved it: the format's fields, no (or zero) weights."""
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {} if weights is None else {"weights": weights}
    with open(path, "wb") as f:
        np.savez(f, format=np.array("tidejax-history/1"), counts=counts, steps=np.array(40),
                 half_life=np.array(8.0), **extra)


@pytest.mark.parametrize("weights", [None, "zeros"])
def test_a_count_only_history_loads_and_migrates_at_its_first_drain(tmp_path, weights):
    counts = np.zeros((L, E))
    counts[:, 4:] = [[8.0, 6.0, 4.0, 2.0]]
    path = tmp_path / "state" / "history.npz"
    old_history(path, counts, None if weights is None else np.zeros_like(counts))
    res, state = manager(tmp_path, drain_every=1000, adapt=False)
    history = res.history
    assert history.from_counts and history.steps == 40
    np.testing.assert_array_equal(history.demand, counts)  # ranks by its counts until a drain
    assert (res.slot_rows[:res.n_resident].reshape(L, -1) % E == [4, 5, 6, 7]).all()
    res.save()
    assert History.read(path).from_counts  # still pending after a save
    new_counts, new_weights = np.full((L, E), 2.0), np.full((L, E), 0.5)  # 0.25 a pick
    history.add(new_counts, new_weights, 8)  # one half-life
    assert not history.from_counts
    np.testing.assert_allclose(history.weights, counts * 0.25 * 0.5 + new_weights)
    res.save()
    again = History.read(path)
    assert not again.from_counts
    np.testing.assert_allclose(again.weights, history.weights)
