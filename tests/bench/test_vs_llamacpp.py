"""bench/vs_llamacpp.py on the CPU: its arguments, the llama.cpp command lines it builds, its
parsers on llama-bench's and llama-batched-bench's own output (tests/data/llamacpp: a CPU build
on the tiny synthetic's GGUF), the table, and its tidejax half end to end on a tiny synthetic
checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

from bench import vs_llamacpp as vs

SAMPLES = REPO / "tests" / "data" / "llamacpp"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vs") / "tiny"
    subprocess.run([sys.executable, "-m", "tools.make_synthetic", str(out), "--tiny",
                    "--workers", "1"], cwd=REPO, check=True, capture_output=True)
    return out


def test_arguments_and_their_errors(tiny, tmp_path, capsys):
    args = vs.parse_args(["--model", str(tiny), "--engines", "tidejax", "--results",
                          str(tmp_path / "r.json")])
    assert (args.resident, args.lanes, args.prompts, args.tokens, args.chunk) == (
        [1.0, 0.65], [1, 4], [512, 4096], 128, 512)
    assert args.engines == ["tidejax"] and args.trace == "" and args.policy == "exact"
    for bad, message in ((["--engines", "vllm"], "'vllm' is not one of"),
                         ([], "--engines llama.cpp needs --llama and --gguf"),
                         (["--llama", str(tmp_path), "--gguf", str(tmp_path / "no.gguf")],
                          "no such file")):
        with pytest.raises(SystemExit):
            vs.parse_args(["--model", str(tiny), *bad])
        assert message in capsys.readouterr().err


def test_the_split_matches_llamacpps_n_cpu_moe(tiny):
    assert vs.model_dims(tiny) == (1, 2, 16)  # 1 dense layer, 2 MoE layers of 16 experts
    # the 40-layer shape of issue 16: 1 dense + 39 MoE layers; 65% -> 14 host layers, K = 15
    host = vs.host_layers(0.65, 39)
    assert (host, 1 + host, vs.label(39 - host, 39)) == (14, 15, "64%")
    assert vs.host_layers(1.0, 39) == 0
    with pytest.raises(SystemExit, match="a share in"):
        vs.host_layers(0.0, 39)


def test_a_glm45_checkpoint_splits_the_same_way(tmp_path):
    """GLM-4.5 (llama.cpp's glm4moe): its leading dense layers, MoE layers and experts, read by
    its family, as --n-cpu-moe counts them."""
    glm = tmp_path / "glm"
    subprocess.run([sys.executable, "-m", "tools.make_synthetic", str(glm), "--shape", "glm-tiny",
                    "--layers", "4", "--dense-layers", "2", "--n-experts", "8", "--workers", "1"],
                   cwd=REPO, check=True, capture_output=True)
    assert vs.model_dims(glm) == (2, 2, 8)
    args = vs.parse_args(["--model", str(glm), "--engines", "tidejax"])
    assert args.model == glm


def test_command_lines(tmp_path):
    exe, gguf = tmp_path / "llama-bench", tmp_path / "m.gguf"
    assert vs.llama_bench_cmd(exe, gguf, 15, [512, 4096], 512, 3, None) == [
        str(exe), "-m", str(gguf), "-ngl", "99", "-fa", "1", "-ncmoe", "15", "-p", "512,4096",
        "-n", "0", "-b", "4096", "-ub", "512", "-r", "3", "-o", "json"]
    assert vs.batched_bench_cmd(exe, gguf, 0, [1, 4], 128, 512, 16) == [
        str(exe), "-m", str(gguf), "-ngl", "99", "-fa", "on", "--n-cpu-moe", "0", "-c", "768",
        "-ub", "512", "-npp", "64", "-ntg", "128", "-npl", "1,4", "--output-format", "jsonl",
        "-t", "16"]
    with pytest.raises(SystemExit, match="no llama-bench"):
        vs.binary(tmp_path, "llama-bench")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-bench").write_text("")
    (tmp_path / "bin" / "llama-bench").chmod(0o755)
    assert vs.binary(tmp_path, "llama-bench") == tmp_path / "bin" / "llama-bench"


def test_parsers_read_llamacpps_output_formats():
    prefill = vs.parse_llama_bench((SAMPLES / "llama-bench.json").read_text())
    tests = json.loads((SAMPLES / "llama-bench.json").read_text())
    assert prefill == {t["n_prompt"]: t["avg_ts"] for t in tests} and len(prefill) == 2
    decode = vs.parse_batched_bench((SAMPLES / "batched-bench.jsonl").read_text())
    rows = [json.loads(line) for line in (SAMPLES / "batched-bench.jsonl").read_text().splitlines()
            if line.startswith("{")]
    assert decode == {r["pl"]: r["speed_tg"] for r in rows} and sorted(decode) == [1, 4]
    with pytest.raises(RuntimeError, match="no JSON list"):
        vs.parse_llama_bench("error: failed to load model\n")


def test_table_has_both_engines_and_their_ratio():
    results = {"llama.cpp": {"100%": {"decode_1": 50.0, "prefill_512": 400.0, "n_cpu_moe": 0}},
               "tidejax": {"100%": {"decode_1": 75.0, "prefill_512": 200.0,
                                    "policy": "all resident"}}}
    rows = vs.table(results, [1], [512]).splitlines()[2:]
    assert rows == ["| 100% | 0 | all resident | decode, 1 lane | 50.0 | 75.0 | 1.50 |",
                    "| 100% | 0 | all resident | prefill, 512 tokens | 400.0 | 200.0 | 0.50 |"]


def test_tidejax_half_runs_and_merges_into_the_results(tiny, tmp_path, capsys):
    """At half the MoE layers' experts (16 of 32) with exact misses; the prompt length of the
    decode warm-up (64) in one chunk, one page a sequence and no counter drain keep the compiles
    to the warm-up's."""
    results = tmp_path / "vs.json"
    theirs = {"50%": {"decode_1": 100.0, "n_cpu_moe": 2}}
    results.write_text(json.dumps({"llama.cpp": theirs}))
    assert vs.main(["--model", str(tiny), "--engines", "tidejax", "--resident", "0.5",
                    "--lanes", "1,2", "--prompts", "64", "--tokens", "8", "--chunk", "64",
                    "--reps", "1", "--results", str(results),
                    "--set", "residency.drain_every=1000", "--set", "engine.page_size=256"]) == 0
    saved = json.loads(results.read_text())
    assert saved["llama.cpp"] == theirs  # kept
    ours = saved["tidejax"]["50%"]
    assert all(ours[m] > 0 for m in ("decode_1", "decode_2", "prefill_64")), ours
    assert (ours["policy"], ours["resident_experts"], ours["experts"]) == ("exact", 16, 32)
    assert ours["cold_share"] > 0  # misses were served
    table = capsys.readouterr().out.split("| GPU share")[-1].splitlines()
    ratio = ours["decode_1"] / 100.0
    assert (f"| 50% | 2 | exact, cold share {ours['cold_share']:.2f} | decode, 1 lane | 100.0 | "
            f"{ours['decode_1']:.1f} | {ratio:.2f} |") in table
