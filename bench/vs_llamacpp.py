"""tidejax beside llama.cpp on the same weights: decode at 1 and 4 lanes, prefill of 512 and 4096
tokens, with all routed experts on the GPU and with ~65% of them there.

    python -m bench.vs_llamacpp --llama BUILD_DIR --gguf MODEL.gguf --model SYNTHETIC_DIR
        [--resident 1.0,0.65] [--lanes 1,4] [--prompts 512,4096] [--tokens 128] [--chunk 512]
        [--policy exact] [--reps 3] [--engines llama.cpp,tidejax] [--results FILE]
        [--set table.key=value ...]

BUILD_DIR holds llama.cpp's llama-bench and llama-batched-bench (tools/build_llamacpp.sh), the
GGUF is tools/make_gguf.py's of SYNTHETIC_DIR (tools/make_synthetic.py): a DeepSeek-V3-family
shape (llama.cpp's deepseek2) or a GLM-4.5 one (glm4moe: --shape glm45-air, glm45, glm-tiny).
The split below is read from SYNTHETIC_DIR's config.json by its tidejax family, the same for
both. Both engines run the router's own routing on those weights (no replayed trace), all layers
on the GPU.

A resident share s puts the routed experts of round((1 - s) x MoE layers) layers on the host:
llama.cpp keeps the experts of its first K blocks in host memory and computes them on the CPU
(`--n-cpu-moe K`, K counting the leading dense blocks, which have none); tidejax keeps the same
number of experts in its GPU bank (`residency.budget_experts`, spread over every layer) and
serves the rest by `--policy` (exact: copied in from the host pool inside the step). The share
printed is the one both ran, (MoE layers - host layers) / MoE layers.

  llama.cpp decode   llama-batched-bench -npp 64 -ntg TOKENS -npl LANES: S_TG, the tokens of all
                     lanes a second (random prompt tokens; llama_synchronize after every step)
  llama.cpp prefill  llama-bench -p PROMPTS -n 0 -ub CHUNK -r REPS: avg_ts of each prompt
  tidejax decode     bench/roofline.py's steady decode steps: LANES requests of 64 held-out prompt
                     tokens each decoding TOKENS (ignore_eos), median step time
  tidejax prefill    submit to first token of a PROMPT-token request (engine.prefill_chunk CHUNK),
                     median of REPS after one that compiles

llama.cpp runs first (in subprocesses, before JAX takes the GPU's memory). Each run's figures are
merged into --results (JSON, default /tmp/vs_llamacpp.json: outside the repository copy the device
tool replaces on every call), and the table is printed from everything there, so the engines can
run in separate calls (`--engines llama.cpp`, then `--engines tidejax`) and still meet in one
table. With $OUT set the table and the JSON are also written there.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from bench import roofline
from bench.roofline import PROMPT_TOKENS
from tidejax.fields import read_json
from tidejax.models.registry import family_for

ENGINES = ("llama.cpp", "tidejax")
NGL = "99"  # every layer on the GPU (the synthetic shapes have at most 92, glm45's)


def measures(lanes: list[int], prompts: list[int]) -> list[str]:
    """The table's rows, in order: decode_1, decode_4, prefill_512, prefill_4096."""
    return [f"decode_{n}" for n in lanes] + [f"prefill_{n}" for n in prompts]


# -- the split between GPU and host ----------------------------------------------------------------

def model_dims(model: Path) -> tuple[int, int, int]:
    """(leading dense layers, MoE layers, routed experts a layer) of a checkpoint whose MoE layers
    follow the dense ones (as llama.cpp's --n-cpu-moe assumes): DeepSeek-V3 family, GLM-4.5."""
    path = model / "config.json"
    raw = read_json(path)
    family = family_for(raw, str(path))
    cfg = family.config_from_hf(raw, str(path))
    moe = list(getattr(cfg, "moe_layers", ()))
    if not moe or moe != list(range(moe[0], cfg.num_layers)):
        raise SystemExit(f"error: {path}: the MoE layers {moe} are not the trailing layers of "
                         f"{cfg.num_layers} (a DeepSeek-V3-family or GLM-4.5 checkpoint is needed)")
    return moe[0], len(moe), family.expert_dims(cfg)[1]


def host_layers(share: float, n_moe: int) -> int:
    """MoE layers whose experts live on the host at resident share `share`."""
    if not 0.0 < share <= 1.0:
        raise SystemExit(f"error: --resident {share}: a share in (0, 1]")
    return round((1.0 - share) * n_moe)


def label(gpu_layers: int, n_moe: int) -> str:
    return f"{gpu_layers / n_moe:.0%}"


# -- llama.cpp -------------------------------------------------------------------------------------

def binary(build: Path, name: str) -> Path:
    for path in (build / "bin" / name, build / name):
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise SystemExit(f"error: --llama {build}: no {name} in it or in its bin/ "
                     "(tools/build_llamacpp.sh build ...)")


def llama_bench_cmd(exe: Path, gguf: Path, n_cpu_moe: int, prompts: list[int], chunk: int,
                    reps: int, threads: int | None) -> list[str]:
    """Prefill of each prompt length (no generation), flash attention, JSON on stdout."""
    return [str(exe), "-m", str(gguf), "-ngl", NGL, "-fa", "1", "-ncmoe", str(n_cpu_moe),
            "-p", ",".join(map(str, prompts)), "-n", "0", "-b", str(max(prompts)),
            "-ub", str(chunk), "-r", str(reps), "-o", "json"] + (
        ["-t", str(threads)] if threads else [])


def batched_bench_cmd(exe: Path, gguf: Path, n_cpu_moe: int, lanes: list[int], tokens: int,
                      chunk: int, threads: int | None) -> list[str]:
    """Decode of `tokens` on each of LANES sequences after a PROMPT_TOKENS prompt, JSONL out."""
    return [str(exe), "-m", str(gguf), "-ngl", NGL, "-fa", "on", "--n-cpu-moe", str(n_cpu_moe),
            "-c", str(max(lanes) * (PROMPT_TOKENS + tokens)), "-ub", str(chunk),
            "-npp", str(PROMPT_TOKENS), "-ntg", str(tokens), "-npl", ",".join(map(str, lanes)),
            "--output-format", "jsonl"] + (["-t", str(threads)] if threads else [])


def parse_llama_bench(text: str) -> dict[int, float]:
    """llama-bench -o json (a list of tests) -> {n_prompt: avg_ts} of its prefill tests."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as e:
        raise RuntimeError(f"llama-bench printed no JSON list ({e}): {text[-300:]!r}") from None
    return {t["n_prompt"]: float(t["avg_ts"]) for t in tests if t["n_gen"] == 0}


def parse_batched_bench(text: str) -> dict[int, float]:
    """llama-batched-bench --output-format jsonl -> {lanes (pl): speed_tg, tokens a second}."""
    rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return {r["pl"]: float(r["speed_tg"]) for r in rows}


def run(cmd: list[str], timeout: float) -> str:
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} exited {done.returncode}: {done.stderr[-2000:]}")
    print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    return done.stdout


def run_llamacpp(args, dense: int, n_moe: int) -> dict[str, dict[str, float]]:
    bench, batched = binary(args.llama, "llama-bench"), binary(args.llama, "llama-batched-bench")
    out = {}
    for share in args.resident:
        host = host_layers(share, n_moe)
        k = dense + host if host else 0  # --n-cpu-moe counts blocks from the first, dense included
        prefill = parse_llama_bench(run(llama_bench_cmd(
            bench, args.gguf, k, args.prompts, args.chunk, args.reps, args.threads), args.timeout))
        decode = parse_batched_bench(run(batched_bench_cmd(
            batched, args.gguf, k, args.lanes, args.tokens, args.chunk, args.threads), args.timeout))
        figures = {f"decode_{n}": decode[n] for n in args.lanes} | {
            f"prefill_{n}": prefill[n] for n in args.prompts}
        out[label(n_moe - host, n_moe)] = figures | {"n_cpu_moe": k}
        print(f"llama.cpp [{label(n_moe - host, n_moe)}, --n-cpu-moe {k}] {figures}", flush=True)
    return out


# -- tidejax ---------------------------------------------------------------------------------------

def prefill_tok_s(engine, n: int, reps: int, domain: str) -> float:
    """Prompt tokens a second from submit to first token of an `n`-token prompt, the median of
    `reps` runs after one that compiles its chunk and page-table shapes."""
    ids = roofline.prompt_ids(engine, domain, n)
    roofline.time_to_first_token(engine, ids)
    return n / statistics.median(roofline.time_to_first_token(engine, ids) for _ in range(reps))


def run_tidejax(args, n_moe: int) -> dict[str, dict[str, float]]:
    overrides = roofline.parse_set(args.set)
    overrides.setdefault("engine", {}).setdefault("prefill_chunk", args.chunk)
    max_context = max(max(args.prompts), PROMPT_TOKENS + args.tokens) + 64
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for share in args.resident:
            gpu_layers = n_moe - host_layers(share, n_moe)
            resident = gpu_layers / n_moe  # budget_experts = gpu_layers x experts a layer
            policy = args.policy if resident < 1.0 else None
            engine, _ = roofline.load_config(str(args.model), resident, policy, args, overrides,
                                             Path(tmp), max_context)
            drains = engine.config.residency.drain_every <= args.tokens + PROMPT_TOKENS
            roofline.warm_up(engine, args.domain, PROMPT_TOKENS, max(args.lanes), drains)
            figures = {}
            for lanes in args.lanes:
                _, steady = roofline.steady_decode(engine, lanes, args.tokens, args.domain)
                figures[f"decode_{lanes}"] = lanes / statistics.median(r.seconds for r in steady)
            for n in args.prompts:
                figures[f"prefill_{n}"] = prefill_tok_s(engine, n, args.reps, args.domain)
            stats = roofline.residency_stats(engine)
            out[label(gpu_layers, n_moe)] = figures | {
                "policy": policy or "all resident", "cold_share": stats["cold_share_total"],
                "resident_experts": stats["resident"], "experts": stats["experts"]}
            print(f"tidejax [{label(gpu_layers, n_moe)} {policy or ''}] {figures}", flush=True)
            del engine
            gc.collect()  # free the pool and the bank before the next configuration loads
    return out


# -- the table -------------------------------------------------------------------------------------

def table(results: dict, lanes: list[int], prompts: list[int]) -> str:
    """One markdown table: every share x measure, both engines' tok/s and their ratio."""
    lines = ["| GPU share of routed experts | llama.cpp --n-cpu-moe | tidejax policy | measure | "
             "llama.cpp tok/s | tidejax tok/s | tidejax / llama.cpp |", "|" + " --- |" * 7]
    theirs, ours = results.get("llama.cpp", {}), results.get("tidejax", {})
    for share in sorted(set(theirs) | set(ours), key=lambda s: -float(s.rstrip("%"))):
        a, b = theirs.get(share, {}), ours.get(share, {})
        for m in measures(lanes, prompts):
            x, y = a.get(m), b.get(m)
            what = (f"decode, {m.split('_')[1]} lane{'s' if m != 'decode_1' else ''}"
                    if m.startswith("decode") else f"prefill, {m.split('_')[1]} tokens")
            policy = b.get("policy", "") + (f", cold share {b['cold_share']:.2f}"
                                             if b.get("cold_share") else "")
            cells = [share, str(a.get("n_cpu_moe", "")), policy, what,
                     f"{x:.1f}" if x is not None else "", f"{y:.1f}" if y is not None else "",
                     f"{y / x:.2f}" if x and y is not None else ""]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama", type=Path, help="llama.cpp build dir (llama-bench, "
                        "llama-batched-bench in it or its bin/); needed for --engines llama.cpp")
    parser.add_argument("--gguf", type=Path, help="tools/make_gguf.py's GGUF of --model")
    parser.add_argument("--model", type=Path, required=True, help="the synthetic checkpoint dir")
    parser.add_argument("--resident", default="1.0,0.65", help="GPU shares of routed experts")
    parser.add_argument("--lanes", default="1,4", help="decode lanes (sequences)")
    parser.add_argument("--prompts", default="512,4096", help="prefill prompt lengths")
    parser.add_argument("--tokens", type=int, default=128, help="decoded tokens a lane")
    parser.add_argument("--chunk", type=int, default=512,
                        help="prefill chunk: llama.cpp's -ub, tidejax's engine.prefill_chunk")
    parser.add_argument("--policy", default="exact", help="tidejax's miss policy below share 1")
    parser.add_argument("--reps", type=int, default=3, help="prefill repetitions")
    parser.add_argument("--threads", type=int, help="llama.cpp's CPU threads (default: its own)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="which engines run now")
    parser.add_argument("--results", type=Path,
                        default=Path(tempfile.gettempdir()) / "vs_llamacpp.json",
                        help="JSON the figures merge into, kept between runs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a llama.cpp run")
    parser.add_argument("--domain", default="en", help="held-out text of tidejax's prompts")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="tidejax profile overrides")
    args = parser.parse_args(argv)
    args.resident = [float(x) for x in args.resident.split(",")]
    args.lanes = [int(x) for x in args.lanes.split(",")]
    args.prompts = [int(x) for x in args.prompts.split(",")]
    args.engines = args.engines.split(",")
    args.trace = ""  # both engines route by the checkpoint's own router
    for engine in args.engines:
        if engine not in ENGINES:
            parser.error(f"--engines: {engine!r} is not one of {', '.join(ENGINES)}")
    if "llama.cpp" in args.engines and (args.llama is None or args.gguf is None):
        parser.error("--engines llama.cpp needs --llama and --gguf")
    if args.gguf is not None and not args.gguf.is_file():
        parser.error(f"--gguf {args.gguf}: no such file (tools/make_gguf.py writes it)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    dense, n_moe, n_experts = model_dims(args.model)
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    if "llama.cpp" in args.engines:  # first: JAX would hold the GPU's memory from its first use
        results.setdefault("llama.cpp", {}).update(run_llamacpp(args, dense, n_moe))
        args.results.write_text(json.dumps(results, indent=1))
    if "tidejax" in args.engines:
        results.setdefault("tidejax", {}).update(run_tidejax(args, n_moe))
        args.results.write_text(json.dumps(results, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "vs_llamacpp.json").write_text(json.dumps(results, indent=1))
    roofline.report("vs_llamacpp.md", (
        f"{datetime.date.today()}, {args.model.name}: {dense} dense + {n_moe} MoE layers x "
        f"{n_experts} experts; decode after a {PROMPT_TOKENS}-token prompt, {args.tokens} tokens "
        f"a lane; prefill chunk {args.chunk}; figures in {args.results}\n\n"
        + table(results, args.lanes, args.prompts) + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
