"""python -m tidejax.residency simulate: a trace recorded from the demo engine, replayed at the
engine's own budget, predicts the cold share the engine measured on it, at both tiers (the bank
and, with a host budget, host memory over the disk); under `ring` and `auto` the replay's copies,
host picks and threshold are the engine's; --target-tps, the PNG, the steady state of a history
and bad input. The traces are the engine's own, by its routing trace recorder
(tidejax/residency/trace.py)."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import tidejax
from tidejax.residency import seedmap, simulate
from tidejax.residency.__main__ import main as residency_cli

REPO = Path(__file__).resolve().parents[2]
BUDGET = 72  # of 3 x 48: 24 a layer
HOST_BUDGET = 96  # experts in host memory, the other 48 read from disk
SETTINGS = {"budget_experts": BUDGET, "miss_policy": "substitute", "drain_every": 4,
            "half_life": 16.0, "max_swaps_per_step": 4}
PROMPTS = ["def parse(line):", "Le chat dort dans le jardin.", "The tide comes in and",
           "Package: python3-numpy\nDescription:"]
MACHINE = ["--lanes", "2", "--expert-bytes", "200000", "--step-mib", "4", "--hbm-gbps", "50",
           "--h2d-gbps", "10", "--disk-gbps", "0.5"]


def record(tmp: Path, prompts: list[str], tokens: int, **residency):
    """(trace folder, the engine's residency stats, its state_dir): the demo engine at 24 of 48
    experts a layer, booted from a map of its least wanted experts, adapting while it serves
    `prompts` for `tokens` tokens each, with `residency` over SETTINGS."""
    n_layers, n_experts = 3, 48
    boot = [layer * n_experts + e for layer in range(n_layers) for e in range(24, 48)]
    seedmap.write({"format": seedmap.FORMAT, "geometry": "per_layer", "n_layers": n_layers,
                   "n_experts": n_experts, "budget": BUDGET, "rows": boot}, tmp / "boot.json")
    residency = SETTINGS | {"seed_map": str(tmp / "boot.json"), "state_dir": str(tmp / "state"),
                            "trace_every_steps": 1} | residency
    engine = tidejax.load(REPO / "models" / "demo", residency=residency,
                          engine={"max_context": 128, "prefill_chunk": 16, "lanes": 2})
    assert engine.family.expert_dims(engine.cfg)[:2] == (n_layers, n_experts)
    engine.generate(prompts, max_new_tokens=tokens)
    engine.residency.flush()
    stats = engine.residency.stats()
    engine.close()  # drains and saves the history under state_dir (and the trace's last chunk)
    return tmp / "state" / "routing", stats, tmp / "state"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """`substitute` with HOST_BUDGET experts in host memory, the rest on disk."""
    return record(tmp_path_factory.mktemp("simulate"), PROMPTS, 28,
                  host_budget_experts=HOST_BUDGET)


def replay_as_recorded(folder: Path) -> simulate.Outcome:
    """The trace replayed at its engine's budgets and settings."""
    trace = simulate.read_trace(folder)
    section = simulate.settings_of(trace.settings, [])
    return simulate.replay(trace, section, BUDGET, 2, seedmap.read(section.seed_map, 3, 48),
                           section.host_budget_experts)


def test_replay_at_the_engines_budget_predicts_its_cold_share(recorded, tmp_path, capsys):
    folder, stats, _ = recorded
    assert stats["swaps_applied"] > 0 and stats["drains"] > 2  # the map moved while serving
    trace = simulate.read_trace(folder)
    # the trace holds the engine's own tally: its recorded resident flags
    assert trace.measured_cold_share() == pytest.approx(stats["cold_share_total"], abs=1e-9)
    rows_json = tmp_path / "rows.json"
    assert residency_cli(["simulate", "--trace", str(folder), "--budgets", f"24,{BUDGET},144",
                          "--host-budgets", f"{HOST_BUDGET},0", "--json", str(rows_json),
                          *MACHINE]) == 0
    both = {(row["budget"], row["host_budget"]): row for row in json.loads(rows_json.read_text())}
    assert (144, HOST_BUDGET) not in both  # a bank as large as the host's: the engine refuses
    rows = {budget: both[budget, HOST_BUDGET] for budget in (24, BUDGET)} | {144: both[144, 0]}
    assert abs(rows[BUDGET]["cold_share"] - stats["cold_share_total"]) <= 0.02
    assert abs(rows[BUDGET]["decode_cold_share"] - trace.measured_cold_share(lanes=2)) <= 0.02
    # the swaps the replay planned are the engine's, per 1K routed tokens
    assert rows[BUDGET]["swaps_per_1k_tokens"] == pytest.approx(
        1000 * stats["swaps_applied"] / trace.tokens.sum(), rel=0.1)
    assert rows[144]["cold_share"] == 0 and rows[24]["cold_share"] > rows[BUDGET]["cold_share"]
    assert f"measured a cold share of {stats['cold_share_total']:.4f}" in capsys.readouterr().out
    # the host tier: picks of experts on disk, and the rows read (the engine's less its boot's)
    assert 0 < stats["host_cold_share_total"] < stats["cold_share_total"]
    # the replay's host tier is the engine's own (place_landed; at each drain the prefetch's
    # worth_reading and prefetch_room); what it assumes is the reads' timing, each landing by
    # the next step's commit (DESIGN "Simulating a budget"): a read the engine commits a step
    # late moves the share a little (0 to 0.001 here), and 0.01 is room for a loaded machine.
    # Without the prefetch the replay ran 0.028 and 0.037 above the engine.
    assert abs(rows[BUDGET]["host_cold_share"] - stats["host_cold_share_total"]) <= 0.01
    assert rows[BUDGET]["disk_reads"] == pytest.approx(stats["disk_reads"] - BUDGET, rel=0.1)
    assert replay_as_recorded(folder).disk_prefetches == pytest.approx(stats["disk_prefetches"],
                                                                       rel=0.1)
    # under exact every distinct miss crosses PCIe too: more budget, fewer bytes, faster
    assert residency_cli(["simulate", "--trace", str(folder), "--budgets", f"24,{BUDGET},144",
                          "--set", "residency.miss_policy=exact", "--host-budgets", "0",
                          "--json", str(rows_json), *MACHINE]) == 0
    exact = {row["budget"]: row for row in json.loads(rows_json.read_text())}
    assert exact[BUDGET]["cold_share"] == both[BUDGET, 0]["cold_share"]
    assert exact[BUDGET]["pcie_bytes_per_token"] > both[BUDGET, 0]["pcie_bytes_per_token"]
    assert exact[24]["decode_tps"] < exact[BUDGET]["decode_tps"] < exact[144]["decode_tps"]


def test_target_tps_answers_the_smallest_budget_that_reaches_it(recorded, capsys):
    folder = recorded[0]
    trace = simulate.read_trace(folder)
    section = simulate.settings_of(trace.settings, [])
    boot = seedmap.read(section.seed_map, 3, 48)
    section = dataclasses.replace(section, miss_policy="exact")
    machine = simulate.Machine(200000, 4 * 2**20, 50.0, 10.0)

    def tps(budget):
        return machine.decode_tps(simulate.replay(trace, section, budget, 2, boot))
    target = (tps(48) + tps(96)) / 2
    assert residency_cli(["simulate", "--trace", str(folder), "--budgets", "72",
                          "--set", "residency.miss_policy=exact", "--host-budgets", "0",
                          "--target-tps", f"{target}", *MACHINE]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    answer = int(line.split(": ")[1].split()[0])
    assert tps(answer) >= target > tps(answer - 3)
    assert residency_cli(["simulate", "--trace", str(folder), "--budgets", "72",
                          "--target-tps", "1e9", *MACHINE]) == 0
    assert "not reached" in capsys.readouterr().out


def test_png_or_a_clear_refusal(recorded, tmp_path, capsys):
    png = tmp_path / "budget.png"
    code = residency_cli(["simulate", "--trace", str(recorded[0]), "--budgets", "48,96",
                          "--png", str(png), *MACHINE])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert code == 2 and not png.exists()
        assert capsys.readouterr().err.strip() == (
            "error: --png needs matplotlib, an optional extra: pip install 'tidejax[plot]'")
        return
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_history_gives_its_steady_state(recorded, tmp_path):
    history = recorded[2] / "history.npz"
    rows_json = tmp_path / "rows.json"
    assert residency_cli(["simulate", "--history", str(history), "--top-k", "6", "--budgets",
                          "24,72,144", "--json", str(rows_json), *MACHINE]) == 0
    rows = json.loads(rows_json.read_text())
    assert [r["swaps_per_1k_tokens"] for r in rows] == [0, 0, 0]
    cold = [r["cold_share"] for r in rows]
    assert cold[0] > cold[1] > cold[2] == 0
    assert rows[0]["decode_tps"] < rows[1]["decode_tps"] < rows[2]["decode_tps"]
    # 96 in host memory: the picks of the other 48 come from disk; `exact` reads them in the step
    assert residency_cli(["simulate", "--history", str(history), "--top-k", "6", "--budgets",
                          "72", "--host-budgets", "96,0", "--set", "residency.miss_policy=exact",
                          "--json", str(rows_json), *MACHINE]) == 0
    all_in_host, tiered = json.loads(rows_json.read_text())  # host budgets in order
    assert tiered["cold_share"] == all_in_host["cold_share"] == cold[1]
    assert 0 < tiered["host_cold_share"] < tiered["cold_share"]
    assert tiered["disk_bytes_per_token"] > 0 == all_in_host["disk_bytes_per_token"]
    assert tiered["decode_tps"] < all_in_host["decode_tps"]


def _bad_chunk(folder: Path) -> None:
    (folder / "header.json").write_text(json.dumps({
        "format": "tidejax-routing-trace", "version": 1, "n_layers": 3, "n_experts": 48,
        "top_k": 6, "trace_every_steps": 1}))
    np.savez(folder / "trace-000000000000.npz", step=np.zeros(1, np.int64),
             map_version=np.zeros(1, np.int64), tokens=np.array([2], np.int32),
             ids=np.zeros((2, 3, 5), np.int16), weights=np.zeros((2, 3, 5), np.float32),
             resident=np.ones((2, 3, 5), bool))


@pytest.mark.parametrize("make, args, message", [
    (None, ["--trace", "{tmp}/nowhere"], "{tmp}/nowhere/header.json: no routing trace header"),
    (lambda f: (f / "header.json").write_text('{"format": "other"}'), ["--trace", "{tmp}"],
     "{tmp}/header.json: format 'other' version None, expected 'tidejax-routing-trace' 1"),
    (_bad_chunk, ["--trace", "{tmp}"], "{tmp}: field 'ids' has shape (2, 3, 5), expected "
     "(2, 3, 6) (tokens.sum(), n_layers, top_k)"),
    (lambda f: _bad_chunk(f) or (f / "trace-000000000001.npz").write_bytes(b"torn"),
     ["--trace", "{tmp}"], "{tmp}/trace-000000000001.npz: not a routing trace chunk"),
    (lambda f: (f / "h.npz").write_bytes(b"not numpy"), ["--history", "{tmp}/h.npz",
     "--top-k", "6"], "{tmp}/h.npz: not a demand history"),
    (None, ["--history", "{tmp}/h.npz"], "--history needs --top-k (the model's picks per "
     "token)"),
    (None, ["--history", "{tmp}/none.npz", "--top-k", "6"], "{tmp}/none.npz: No such file"),
    (None, ["--trace", "{tmp}", "--top-k", "6"], "--top-k does not apply here"),
])
def test_bad_input_is_one_clear_line(tmp_path, capsys, make, args, message):
    if make:
        make(tmp_path)
    args = [a.format(tmp=tmp_path) for a in args]
    assert residency_cli(["simulate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: " + message.format(tmp=tmp_path))


def test_host_budgets_trade_disk_reads_for_host_memory(recorded, tmp_path, capsys):
    rows_json = tmp_path / "rows.json"
    assert residency_cli(["simulate", "--trace", str(recorded[0]), "--budgets", f"{BUDGET}",
                          "--host-budgets", "84,120,0", "--json", str(rows_json),
                          *MACHINE]) == 0
    rows = {row["host_budget"]: row for row in json.loads(rows_json.read_text())}
    assert rows[84]["host_cold_share"] > rows[120]["host_cold_share"] > 0
    assert rows[0]["host_cold_share"] == 0 and rows[0]["disk_bytes_per_token"] == 0
    # more host memory, fewer rows read once the prefetch has filled the slots the boot left
    # free (it holds the bank's rows alone: 12 free at 84, 48 at 120); over this short trace the
    # filling weighs most, so 120 reads more in all, as the engine does (61 and 70 rows recorded
    # at these budgets, 49 and 22 evictions; the replay's the same)
    assert rows[84]["disk_reads"] - (84 - BUDGET) > rows[120]["disk_reads"] - (120 - BUDGET) > 0
    assert rows[84]["decode_tps"] < rows[0]["decode_tps"]  # swaps wait for their reads
    assert residency_cli(["simulate", "--trace", str(recorded[0]), "--host-budgets", "96",
                          "--target-tps", "1", *MACHINE]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(
        "--target-tps 1 (per_layer, 96 experts in host memory): ")
    assert residency_cli(["simulate", "--trace", str(recorded[0]), "--host-budgets", "96",
                          *MACHINE[:-2]]) == 2
    assert "a host budget reads rows from disk: give --disk-gbps" in capsys.readouterr().err


def test_cpu_over_disk_replays_the_rows_its_steps_read(tmp_path_factory, tmp_path):
    """`cpu` with the host budget: a host pick of a row on disk is read in its step, in the
    engine (cpu_disk_picks) as in the replay (the step's path: `disk`)."""
    folder, stats, _ = record(tmp_path_factory.mktemp("cpu"), PROMPTS[:2], 12,
                              miss_policy="cpu", host_budget_experts=HOST_BUDGET)
    out = replay_as_recorded(folder)
    assert stats["cpu_disk_picks"] == stats["host_misses"] > 0
    assert out.host_picks == out.misses and out.disk > 0
    # the reads' timing is the replay's one assumption (DESIGN "Simulating a budget"): equal
    # here (234 picks of rows on disk, 169 rows read after the boot's), with room for a loaded
    # machine, as in test_replay_at_the_engines_budget_predicts_its_cold_share
    assert out.host_misses == pytest.approx(stats["host_misses"], rel=0.1)
    assert out.disk_reads == pytest.approx(stats["disk_reads"] - BUDGET, rel=0.1)
    rows_json = tmp_path / "rows.json"
    assert residency_cli(["simulate", "--trace", str(folder), "--budgets", f"{BUDGET}",
                          "--host-budgets", f"{HOST_BUDGET},0", "--json", str(rows_json),
                          "--host-gbps", "5", *MACHINE]) == 0
    rows = {row["host_budget"]: row for row in json.loads(rows_json.read_text())}
    assert rows[HOST_BUDGET]["disk_bytes_per_token"] > 0 == rows[0]["disk_bytes_per_token"]
    assert rows[HOST_BUDGET]["decode_tps"] < rows[0]["decode_tps"]  # steps wait for the disk


@pytest.fixture(scope="module", params=["ring", "auto"])
def policy_run(request, tmp_path_factory):
    """(policy, the recorded run) of two prompts under `ring` (6 ring slots) or `auto` (its
    threshold held to a 10% approximate share: it moves)."""
    extra = ({"ring_slots": 6} if request.param == "ring" else
             {"exact_weight": 0.3, "max_approx_share": 0.1})
    return request.param, record(tmp_path_factory.mktemp(request.param), PROMPTS[:2], 12,
                                 miss_policy=request.param, **extra)


def test_ring_and_auto_replay_as_the_engine_served(policy_run, tmp_path):
    policy, (folder, stats, _) = policy_run
    out = replay_as_recorded(folder)
    assert stats["swaps_applied"] > 0 and out.misses > 0
    assert (out.misses, out.wanted, out.swaps) == (stats["misses"], stats["wanted"],
                                                   stats["swaps_applied"])
    assert out.approx_weight_share == pytest.approx(stats["approx_weight_share_total"],
                                                    rel=1e-5)
    rows_json = tmp_path / "rows.json"
    if policy == "ring":
        assert stats["ring_copies"] > 0 and stats["ring_hits"] > 0
        assert (out.ring_copies, out.ring_hits) == (stats["ring_copies"], stats["ring_hits"])
        assert residency_cli(["simulate", "--trace", str(folder), "--budgets", f"{BUDGET}",
                              "--json", str(rows_json), *MACHINE]) == 0
        # every step fetches its 4 ring rows (min(ring_slots, max_swaps_per_step)) over PCIe
        row = json.loads(rows_json.read_text())[0]
        assert row["pcie_bytes_per_token"] == pytest.approx(
            (out.swaps + 4 * len(simulate.read_trace(folder).tokens)) * 200000 / out.tokens)
        return
    assert stats["threshold_lowered"] > 0 and 0 < stats["cpu_picks"] < stats["misses"]
    assert (out.host_picks, out.threshold_lowered) == (stats["cpu_picks"],
                                                       stats["threshold_lowered"])
    assert out.threshold == pytest.approx(stats["exact_weight"])
    assert residency_cli(["simulate", "--trace", str(folder), "--budgets", f"{BUDGET},144",
                          "--json", str(rows_json), "--host-gbps", "5", *MACHINE]) == 0
    rows = json.loads(rows_json.read_text())
    assert rows[0]["host_picks"] == out.host_picks and rows[1]["host_picks"] == 0
    assert rows[0]["decode_tps"] < rows[1]["decode_tps"]


@pytest.mark.parametrize("args, message", [
    (["--set", "residency.miss_policy=ring"], "miss_policy = 'ring' needs residency.ring_slots"),
    (["--set", "residency.miss_policy=ring", "--set", "residency.ring_slots=4"],
     "host budget 96: miss_policy 'ring' over the disk tier is not replayed yet"),
    (["--host-budgets", "200"], "--host-budgets: 200 must be in [0, 144]"),
    (["--set", "residency.miss_policy=auto", "--host-budgets", "0", *MACHINE],
     "miss_policy 'auto' computes misses on the host: give --host-gbps"),
])
def test_what_the_replay_cannot_follow_is_refused(recorded, capsys, args, message):
    assert residency_cli(["simulate", "--trace", str(recorded[0]), *args]) == 2
    assert message in capsys.readouterr().err
