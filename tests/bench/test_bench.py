"""Benchmark tooling: synthetic checkpoints load and route by replayed traces, traces scale to other
models, and the end-to-end scripts (bench.py against a live server, the residency campaign on the
demo model) run and report."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

import tidejax
from bench import profile_step, roofline, step_overhead, traces, verify_step
from tidejax.checkpoint import CheckpointReader, mxfp4
from tidejax.runtime.api import GenerationRequest

DEMO = REPO / "models" / "demo"


def make_synthetic(out: Path, *args: str) -> Path:
    subprocess.run([sys.executable, "-m", "tools.make_synthetic", str(out), "--tiny",
                    "--workers", "2", *args], cwd=REPO, check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> Path:
    return make_synthetic(tmp_path_factory.mktemp("syn") / "bf16", "--experts", "bf16")


@pytest.fixture(scope="module")
def tiny_mxfp4(tmp_path_factory) -> Path:
    """The default (MXFP4 experts) tiny synthetic, written once for the tests that read it."""
    return make_synthetic(tmp_path_factory.mktemp("syn") / "mx")


def test_synthetic_checkpoint_loads_and_routes_by_the_replayed_trace(tiny_bf16):
    engine = tidejax.load(tiny_bf16, engine={"lanes": 1, "max_context": 128})
    n_moe, n_experts = engine.family.expert_dims(engine.cfg)[:2]
    assert (n_moe, n_experts) == (2, 16)
    ids = engine.tokenizer.encode((traces.HELDOUT / "en.txt").read_text())[:40]

    def counted(replay):
        engine.set_routing_replay(replay)
        before = np.asarray(engine.state.experts.counts).copy()
        logits = engine.logits(ids)
        assert np.isfinite(logits).all()
        return np.asarray(engine.state.experts.counts) - before

    picks = traces.scale(traces.load("en"), n_moe, n_experts, engine.cfg.num_experts_per_tok)
    want = np.stack([np.bincount(picks[:len(ids), l].reshape(-1), minlength=n_experts)
                     for l in range(n_moe)])
    np.testing.assert_array_equal(counted(picks), want)
    assert not np.array_equal(counted(None), want)  # the random router picks otherwise


def test_synthetic_mxfp4_experts_are_stored_gpt_oss_style_at_unit_gain(tiny_mxfp4):
    reader = CheckpointReader(tiny_mxfp4, progress=False)
    e, d, i = 16, 64, 32
    prefix = "model.layers.1.mlp.experts"
    shapes = {"gate_up_proj_blocks": (e, 2 * i, d // 32, 16), "gate_up_proj_scales": (e, 2 * i, d // 32),
              "down_proj_blocks": (e, d, i // 32, 16), "down_proj_scales": (e, d, i // 32)}
    for name, shape in shapes.items():
        assert reader.shape(f"{prefix}.{name}") == shape
        assert reader.dtype(f"{prefix}.{name}") == np.uint8
    w = mxfp4.dequantize(reader.read(f"{prefix}.gate_up_proj_blocks"),
                         reader.read(f"{prefix}.gate_up_proj_scales"))  # [E, 2I, D]
    x = np.random.default_rng(0).standard_normal((d, 256)).astype(np.float32)
    gain = float(np.std(w @ x))  # a projection of unit-variance inputs
    assert 0.5 < gain < 2.0 and math.isfinite(gain)


def test_scaled_trace_keeps_each_demo_expert_in_its_block():
    demo = traces.load("python")
    n, l_demo, k_demo = demo.shape
    scaled = traces.scale(demo, 5, 384, 8)
    assert scaled.shape == (n, 5, 8) and scaled.dtype == np.int32
    per_block = 384 // 48
    for layer in range(5):
        np.testing.assert_array_equal(scaled[:, layer, :k_demo] // per_block, demo[:, layer % l_demo])
    assert all(len(set(row)) == 8 for row in scaled.reshape(-1, 8))  # distinct picks per token
    used = np.bincount(scaled[:, 0, 0] % per_block, minlength=per_block)
    assert used.min() > 0.5 * used.mean()  # the hash spreads over the block
    fewer = traces.scale(demo, 2, 16, 4)  # fewer experts than the demo: still distinct, in range
    assert fewer.max() < 16 and all(len(set(row)) == 4 for row in fewer.reshape(-1, 4))


def test_distinct_experts_per_step():
    picks = np.array([[[0, 1]], [[1, 2]], [[3, 4]], [[3, 4]]])  # [N=4, L=1, k=2]
    assert roofline.distinct_experts(picks, 1, 8, 2, 1, 32) == 2.0
    assert roofline.distinct_experts(picks, 2, 8, 2, 1, 1) == 2.5  # {0,1,2} then {3,4}
    # max_context 2: stride 3 (coprime with N = 4), rows 0 and 3, then 2 and 1
    assert roofline.distinct_experts(picks, 2, 8, 2, 1, 2) == 4.0
    # lanes the 2nd and 3rd admissions: windows 1 and 2, rows 1 and 2 ({1,2,3,4}), then 3 and 0
    assert roofline.distinct_experts(picks, 2, 8, 2, 1, 1, first=1) == 4.0
    assert roofline.distinct_experts(None, 4, 8, 2, 3, 32) == 3 * 8.0  # bound: min(batch*k, E)


def test_distinct_experts_groups_rows_as_the_scheduler_routes(tiny_bf16):
    """distinct_experts' lanes take the windows the scheduler gives the requests admitted after
    `first` others since the replay was set (N = 256 rows, max_context 64: stride 65), and a
    new set_routing_replay starts the windows at 0 again."""
    engine = tidejax.load(tiny_bf16, engine={"lanes": 3, "max_context": 64})
    n_moe, n_experts = engine.family.expert_dims(engine.cfg)[:2]
    k = engine.cfg.num_experts_per_tok
    picks = traces.scale(traces.load("en"), n_moe, n_experts, k)[:256]
    engine.set_routing_replay(picks)

    def admitted(count: int) -> list[int]:
        handles = [engine.scheduler.submit(GenerationRequest([5 + i, 7, 9], 1, ignore_eos=True),
                                           lambda event: None) for i in range(count)]
        engine.scheduler.run_until_idle()
        return [h.window for h in handles]

    assert admitted(2) == [0, 65]
    first = engine.loaded.replay_admitted
    windows = np.array(admitted(3))
    np.testing.assert_array_equal(windows, [130, 195, 4])  # (2, 3, 4) * 65 mod 256
    rows = (np.arange(0, 256 - 3 + 1, 3)[:, None] + windows) % 256  # every lane at position p
    want = np.mean([sum(len(np.unique(picks[r, layer])) for layer in range(n_moe)) for r in rows])
    got = roofline.distinct_experts(picks, 3, n_experts, k, n_moe, 64, first)
    assert first == 2 and got == pytest.approx(want)
    engine.set_routing_replay(picks)
    assert admitted(1) == [0]


def test_bench_against_a_live_server(tiny_bf16, tmp_path):
    from tests.support.server_fixtures import live_server, write_profile

    # one chunk bucket (16) and one page a sequence: every request meets the same few step shapes
    profile = write_profile(tmp_path / "p.toml", tiny_bf16,
                            engine={"lanes": 2, "max_context": 512, "prefill_chunk": 16,
                                    "page_size": 512})
    with live_server(profile) as url:
        result = subprocess.run(
            [sys.executable, "-m", "bench.bench", "--url", url, "--tokens", "12",
             "--runs", "1", "--lanes", "1,2", "--ttft-tokens", "300"],
            cwd=REPO, check=True, capture_output=True, text=True, timeout=300)
        soak = subprocess.run(
            [sys.executable, "-m", "bench.soak", "--url", url, "--clients", "2",
             "--minutes", "0.1", "--max-tokens", "12", "--rss-every", "1", "--greedy", "0.5",
             "--greedy-tokens", "8", "--drop", "0.2"],
            cwd=REPO, check=True, capture_output=True, text=True, timeout=300).stdout
    rows = [r for r in result.stdout.splitlines() if r.startswith(("| prose", "| code"))]
    assert len(rows) == 8  # 2 prompts x 2 concurrencies, printed live and in the table
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert int(cells[2]) >= 1 and float(cells[3]) > 0 and float(cells[5]) > 0
    assert "TTFT, prompt of" in result.stdout and " s" in result.stdout.splitlines()[-1]
    # bench/soak.py: two clients for six seconds, every request served, the memory sampled
    served = re.search(r"2 clients for 0\.\d min: (\d+) requests, 0 errors, (\d+) tokens", soak)
    assert served and int(served.group(1)) >= 2 and int(served.group(2)) >= 16, soak
    # greedy texts under load equal the same requests alone; dropped streams cost nothing
    mixed = re.search(r"alone: (\d+) \(0 differ\); streams dropped by the client: (\d+); "
                      r"preemptions: \d+", soak)
    assert mixed and int(mixed.group(1)) >= 1 and int(mixed.group(2)) >= 1, soak
    assert re.search(r"^\| TTFT \| \d", soak, re.M) and re.search(r"^\| total \| \d", soak, re.M)
    rss = re.search(r"^\| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| [+-][\d.]+ \|", soak, re.M)
    assert rss and 10 < float(rss.group(1)) <= float(rss.group(3)), soak


@pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="no bundled demo model")
def test_residency_campaign_quick_on_the_demo_model(tmp_path):
    subprocess.run([sys.executable, "-m", "bench.residency_campaign", "--quick"],
                   cwd=REPO, check=True, capture_output=True, text=True, timeout=900,
                   env={**os.environ, "OUT": str(tmp_path), "JAX_PLATFORMS": "cpu"})
    report = (tmp_path / "campaign.md").read_text()
    rows = [r for r in report.splitlines() if r.startswith(("| fixed", "| adaptive", "| oracle"))]
    assert len(rows) == 6  # 3 variants x 2 phases
    cold = {tuple(c.strip() for c in r.strip("|").split("|")[:2]): float(r.split("|")[5])
            for r in rows}
    # the fixed map was fitted on phase 0's domain: the shift to the other domain raises its cold share
    assert cold[("fixed", "1")] > cold[("fixed", "0")]
    assert (tmp_path / "campaign.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_t90_counts_seconds_to_clear_nine_tenths_of_the_excess():
    from bench.residency_campaign import t90

    t = [0.5 * i for i in range(80)]
    cold = [0.5] * 20 + [0.1] * 60  # the excess (0.4) clears at step 20
    # the 16-step mean first falls to 0.1 + 0.1 * 0.4 at step 34 (one high step left in it)
    assert t90(t, cold) == pytest.approx(17.0)
    assert t90(t, [0.1] * 80) is None  # nothing to clear


def test_roofline_runs_on_a_synthetic_checkpoint(tiny_bf16, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bench.roofline", str(tiny_bf16), "--resident", "1.0",
         "--lanes", "2", "--tokens", "12", "--ttft", "40", "--set", "engine.prefill_chunk=16",
         "--set", "engine.page_size=256",  # one chunk bucket, one page: few step shapes
         "--ceiling-mib", "64"],  # the ceilings over 64 MiB: the CPU streams 1 GiB in ~20 s
        cwd=REPO, check=True, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OUT": str(tmp_path), "JAX_PLATFORMS": "cpu"})
    rows = [r for r in (tmp_path / "roofline.md").read_text().splitlines() if r.startswith("| 100%")]
    assert len(rows) == 1, result.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    tok_s, limit, ratio = float(cells[3]), float(cells[4]), float(cells[5])
    assert tok_s > 0 and limit > 0 and abs(ratio - tok_s / limit) < 0.01
    assert float(cells[10]) > 0  # TTFT


def test_verify_step_times_k_plus_one_positions_against_one(tmp_path, capsys):
    """bench/verify_step.py on a tiny synthetic with an MTP layer (make_synthetic --mtp-layers):
    speculation off, then the MTP layer drafting 2 tokens a step, which it did (drafted > 0,
    at most 3 tokens a step a lane)."""
    model = make_synthetic(tmp_path / "mtp", "--mtp-layers", "1")
    assert verify_step.main([str(model), "--ks", "2", "--lanes", "1", "--tokens", "12",
                             "--set", "engine.max_context=128"]) == 0
    table = capsys.readouterr().out.split("| k |")[-1].splitlines()[2:]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table if line]
    assert [(r[0], r[1], r[2]) for r in rows] == [("0", "1", "1"), ("2", "1", "3")]
    off, on = rows
    assert off[4] == "1.00x" and off[5] == "1.00" and off[6] == "0 / 0"
    accepted, drafted = map(int, on[6].split(" / "))
    assert drafted > 0 and 0 <= accepted <= drafted
    assert 1.0 <= float(on[5]) <= 3.0
    ratio = float(on[3]) / float(off[3])
    assert abs(float(on[4].rstrip("x")) - ratio) < 0.01 + 0.01 * ratio


def test_step_overhead_on_a_tiny_synthetic_checkpoint(tiny_mxfp4, capsys):
    """bench/step_overhead.py runs on a tiny synthetic checkpoint and prints its table."""
    assert step_overhead.main([str(tiny_mxfp4), "--steps", "6", "--lanes", "1,2",
                               "--resident", "1.0,0.5", "--set", "engine.max_context=128",
                               "--set", "residency.drain_every=4"]) == 0
    table = capsys.readouterr().out.split("| resident |")[-1].splitlines()[2:]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    assert [(r[0], r[2]) for r in rows] == [("100%", "1"), ("100%", "2"), ("50%", "1"), ("50%", "2")]
    for row in rows:
        loop, engine, bare, ratio = map(float, row[3:])
        assert loop > 0 and engine > 0 and bare > 0
        assert abs(ratio - loop / bare) < 0.02 * ratio + 0.01


def test_profile_step_attributes_a_step_to_its_model_parts(tiny_mxfp4, capsys):
    """bench/profile_step.py traces bare steps of a tiny synthetic and sums the ops by part: the
    layers' attention and MoE appear with time, the parts add up to the ops' total, and a step
    that carries a prompt chunk runs more kernels and more op time than decoding alone."""
    assert profile_step.main([str(tiny_mxfp4), "--steps", "2", "--resident", "0.5",
                              "--prefill", "0,16", "--set", "engine.max_context=128"]) == 0
    cases = {}
    for case in capsys.readouterr().out.split("\n\n[")[1:]:
        head = re.match(r"(.*)\] wall ([\d.]+) ms a step; (\d+) kernels, busy ([\d.]+) ms, idle "
                        r"([\d.]+) ms a step; ([\d.]+) ms of ops", case)
        assert head, case
        table = case.split("| part |")[1].split("\n\n")[0].splitlines()[2:]
        parts = {row.split("|")[1].strip(): float(row.split("|")[2]) for row in table}
        total = float(head[6])
        assert any(p.endswith("layers/moe") and ms > 0 for p, ms in parts.items()), parts
        assert any(p.endswith("layers/attn") and ms > 0 for p, ms in parts.items()), parts
        assert abs(sum(parts.values()) - total) < 0.01 * total + 0.01
        assert float(head[2]) > 0 and 0 < float(head[4]) <= total + 0.01
        cases[head[1].split("prefill ")[-1]] = (int(head[3]), total)
    assert set(cases) == {"0", "16"}
    assert cases["16"][0] > cases["0"][0] and cases["16"][1] > cases["0"][1]


def test_v41_parts_times_each_part_beside_its_candidate(capsys):
    """bench/v41_parts.py runs the Sinkhorn reference and the Engram gather beside their
    candidates: every row has time and kernels, and each candidate computes what the reference
    does."""
    from bench import v41_parts

    assert v41_parts.main(["--tokens", "3", "--rows", "500", "--sites", "2", "--reps", "1",
                           "--parts", "sinkhorn,engram"]) == 0
    table = capsys.readouterr().out.split("\n\n")[-1].splitlines()[2:]
    rows = [line.split("|")[1:-1] for line in table]
    assert [(r[0].strip(), r[2].strip()) for r in rows] == [
        ("sinkhorn x 2", "loop (reference)"), ("sinkhorn x 2", "loop unrolled"),
        ("sinkhorn x 2", "elementwise loop body"), ("sinkhorn x 2", "triton kernel"),
        ("engram rows", "loop"), ("engram rows", "host gather")]
    for row in rows:
        assert float(row[3]) > 0 and float(row[4]) > 0 and int(row[5]) > 0
        assert float(row[6]) < 1e-5


def test_v41_parts_times_the_mhc_front_as_the_model_ran_it(capsys):
    """bench/v41_parts.py's mHC front: the jnp chain with the Sinkhorn kernel beside the
    reference (the fused form is for the GPU: the bench's docstring says why)."""
    from bench import v41_parts

    assert v41_parts.main(["--tokens", "1", "--sites", "2", "--reps", "1", "--parts", "mhc",
                           "--mhc-forms", "reference,chain"]) == 0
    table = capsys.readouterr().out.split("\n\n")[-1].splitlines()[2:]
    rows = [line.split("|")[1:-1] for line in table]
    assert [r[2].strip() for r in rows] == ["jnp reference", "jnp + sinkhorn kernel"]
    assert all(float(r[4]) > 0 and int(r[5]) > 0 for r in rows) and float(rows[1][6]) < 1e-5


def test_v41_parts_refuses_an_unknown_form():
    from bench import v41_parts

    with pytest.raises(SystemExit):
        v41_parts.main(["--forms", "reference,fused"])


def test_dashboard_bytes_measures_the_heatmaps_polls(capsys):
    """bench.dashboard_bytes on a small map: every row is fewer bytes than the JSON numbers, a
    poll of an unchanged map carries no row, one after a drain at most every row, and a row only
    where a heat byte moved; drains of the expected demand end up sending none."""
    from bench import dashboard_bytes

    out = dashboard_bytes.main(["--layers", "6", "--experts", "32", "--warm-drains", "2",
                                "--drains", "2"])
    assert out["shape"] == [6, 32] and out["unchanged"] < out["every_row"] < out["as_numbers"]
    assert len(out["after_drain"]) == 2
    assert all(0 < rows <= 6 and rows <= moved and size <= out["every_row"] and largest > 0
               for size, rows, moved, largest in out["after_drain"])
    assert "6 x 32: JSON numbers" in capsys.readouterr().out
    steady = dashboard_bytes.main(["--layers", "6", "--experts", "32", "--warm-drains", "2",
                                   "--drains", "80", "--traffic", "expected"])
    assert [rows for _, rows, _, _ in steady["after_drain"][-10:]] == [0] * 10


def test_prompt_cache_serves_turn_2_from_each_tier(tiny_mxfp4, capsys):
    """bench/prompt_cache.py on a tiny synthetic: the cold prompt matches nothing and prefills
    every token; turn 2 from the device, from host memory and, after a restart, from disk each
    matches the shared prefix's 4 pages in that tier alone and prefills only its new tokens; the
    evictions each request made are counted."""
    from bench import prompt_cache

    rows = prompt_cache.main([str(tiny_mxfp4), "--shared", "64", "--new", "10",
                              "--set", "engine.page_size=16", "--set", "engine.prefill_chunk=32"])
    cases = {row.case: row for row in rows}
    assert list(cases) == ["cold", "device", "host", "disk"]
    assert set(cases["cold"].matched.values()) == {0} and cases["cold"].prefilled == 74
    for tier in prompt_cache.TIERS:
        row = cases[tier]
        assert row.matched == {t: 64 if t == tier else 0 for t in prompt_cache.TIERS}, row
        assert row.prefilled == 10 and row.ttft_s > 0
    # the cold prompt evicts turn 1's pages (spilled to host); turn 2 from the device evicts none
    assert cases["cold"].evicted > 0 and cases["device"].evicted == 0
    table = capsys.readouterr().out.split("| model |")[-1].splitlines()[2:]
    assert [line.split("|")[2].strip() for line in table if line] == list(cases)
