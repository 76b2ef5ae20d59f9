"""The shared loading path (runtime.build.load_weights): the expert pool is placed in host memory
first and filled in place, so loading holds it once; what it loads is the checkpoint's bits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.torch import load_file

from bench import load as load_bench
from tests.support.checkpoint_fixtures import to_numpy
from tidejax.fields import read_json
from tidejax.models.deepseek_v3.weights import checkpoint_table
from tidejax.models.registry import family_for
from tidejax.residency.serve import ServeOptions
from tidejax.runtime.build import load_weights
from tests.support.tiny_models import write_deepseek_v3

REPO = Path(__file__).resolve().parents[2]


def _load(model_dir: Path):
    raw = read_json(model_dir / "config.json")
    family = family_for(raw, "config.json")
    cfg = family.config_from_hf(raw, "config.json")
    serve = ServeOptions(swiglu_limit=float(family.swiglu_limit(cfg)))
    params, _, pool = load_weights(family, cfg, model_dir, raw, serve, np.float32, "checkpoint")
    return cfg, params, pool


def _flat(tree, prefix=()):
    for key, value in tree.items():
        yield from (_flat(value, (*prefix, key)) if isinstance(value, dict) else
                    [((*prefix, key), value)])


def test_loading_holds_the_pool_once(tmp_path):
    """400 MB of float32 experts (2 MoE layers x 256) and ~7 MB of dense params: the process
    grows by at most 1.2x the pool while loading (bench/load.py, a fresh process: 1.07x here;
    filling a numpy pool and then placing it grew by 2.04x, the memory-mapped reads' file pages
    counted on top). The pool is large beside what else a load allocates (the reading threads'
    temporaries, the host-buffer probes' compiles), so the bound holds on more cores too."""
    write_deepseek_v3(tmp_path, hidden_size=128, moe_intermediate_size=512, n_routed_experts=256,
                      num_hidden_layers=3, first_k_dense_replace=1)
    result = load_bench.measure(tmp_path, env={"JAX_PLATFORMS": "cpu"})
    assert result["pool"] == 2 * 256 * 3 * 128 * 512 * 4
    assert result["pool_memory"] == ["pinned_host"]
    assert result["grown"] <= 1.2 * result["pool"], result


@pytest.mark.parametrize("layout", ["per-expert float32", "fused mxfp4"])
def test_loaded_params_and_pool_are_the_checkpoints_bits(tmp_path, layout):
    """Every dense param and every pool row against the checkpoint read by safetensors itself:
    transformers' per-expert tensors (gate and up rows joined) and make_synthetic's fused MXFP4
    blocks and scales, read row by row in the loader's threads."""
    if layout == "fused mxfp4":
        subprocess.run([sys.executable, "-m", "tools.make_synthetic", str(tmp_path),
                        "--tiny", "--workers", "1"], check=True, capture_output=True, cwd=REPO)
    else:
        write_deepseek_v3(tmp_path, first_k_dense_replace=1)
    files = read_json(tmp_path / "model.safetensors.index.json")["weight_map"].values() if (
        tmp_path / "model.safetensors.index.json").exists() else ["model.safetensors"]
    stored = {k: to_numpy(v) for f in set(files) for k, v in load_file(tmp_path / f).items()}
    cfg, params, pool = _load(tmp_path)
    table = checkpoint_table(cfg)
    for path, leaf in _flat(params):
        (name,) = [n for n in table.param_names(path) if n in stored]
        want = stored[name].astype(leaf.dtype)
        assert np.asarray(leaf).tobytes() == want.tobytes(), name
    n_experts = cfg.n_routed_experts
    pool = {k: np.asarray(jax.device_get(v)) for k, v in pool.items()}
    for m, layer in enumerate(table.expert_layers):
        for e in range(n_experts):
            row = m * n_experts + e
            if layout == "fused mxfp4":
                want = {f"{p}_{kind}": stored[f"{layer}.experts.{p}_proj_{kind}"][e]
                        for p in ("gate_up", "down") for kind in ("blocks", "scales")}
            else:
                part = {p: stored[f"{layer}.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")}
                want = {"gate_up": np.concatenate([part["gate"], part["up"]]), "down": part["down"]}
            assert set(pool) == set(want)
            for k, w in want.items():
                assert pool[k][row].view(np.uint8).tobytes() == w.view(np.uint8).tobytes(), (k, row)
