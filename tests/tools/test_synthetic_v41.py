"""A synthetic DeepSeek-V4.1 checkpoint (tools/make_synthetic.py --shape ds41-tiny) in the published
layout: the loader takes every tensor of it (FP8 at the config's 32 x 32 blocks, FP4 experts,
FP8 Engram tables; `--vocab` rows of embeddings and head past the demo tokenizer's 4,096 ids),
and the engine decodes it and replays recorded routing."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

import tidejax
from bench import roofline, traces
from tidejax.checkpoint.fp8 import e4m3_to_float32
from tidejax.checkpoint.safetensors_io import SafetensorsFile
from tidejax.runtime.scheduler import GenerationRequest, TokenEvent
from tidejax.errors import CheckpointError
from tidejax.models.deepseek_v41.weights import load

E4M3, E8M0 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e8m0fnu)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds41") / "tiny"
    subprocess.run([sys.executable, "-m", "tools.make_synthetic", str(out),
                    "--shape", "ds41-tiny", "--layers", "5", "--workers", "2", "--vocab", "4160"],
                   cwd=REPO, check=True, capture_output=True)
    return out


def tensors(ckpt: Path) -> dict:
    return {name: info for path in sorted(ckpt.glob("*.safetensors"))
            for name, info in SafetensorsFile(path).tensors.items()}


def test_written_in_the_published_layout(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    t = cfg["text_config"]
    assert cfg["model_type"] == "deepseek_v41"
    assert cfg["quantization_config"]["weight_block_size"] == [32, 32]
    # layers 1, 2, 14, 20, 24 of the 40: Engram, ratio-2 source, ratio-2 source + Engram,
    # ratio-1 source (candidate source), Reindex
    assert cfg["tidejax_synthetic"]["layers_of_40"] == [1, 2, 14, 20, 24]
    assert (t["compress_ratios"], t["kv_source_layer_ids"], t["index_source_layer_ids"],
            t["candidate_source_layer_id"], t["engram_layer_ids"]) == (
        [0, 2, 2, 1, 1], [1, 2, 3], [1, 2, 3, 4], 3, [0, 2])
    found = tensors(ckpt)
    assert not any(name.startswith("model.") for name in found) and "head.weight" in found
    assert t["vocab_size"] == 4160 and found["embed.weight"].shape == (4160, t["hidden_size"])
    assert found["head.weight"].shape == (4160, t["hidden_size"])
    d, i = t["hidden_size"], t["moe_intermediate_size"]
    wq_b = found["layers.1.attn.wq_b.weight"]
    assert wq_b.dtype == E4M3 and found["layers.1.attn.wq_b.scale"].dtype == E8M0
    assert found["layers.1.attn.wq_b.scale"].shape == tuple(math.ceil(n / 32) for n in wq_b.shape)
    w2 = "layers.0.ffn.experts.7.w2"
    assert (found[f"{w2}.weight"].dtype, found[f"{w2}.weight"].shape) == (np.dtype(np.int8), (d, i // 2))
    assert (found[f"{w2}.scale"].dtype, found[f"{w2}.scale"].shape) == (E8M0, (d, i // 32))
    rows, width = t["engram_num_embeddings"][1], t["engram_head_dim"]
    assert found["layers.2.engram.embed.weight"].shape == (rows, width)
    assert found["layers.2.engram.embed.scale"].shape == (rows, width // 32)
    assert "layers.3.attn.compressor.wgate.weight" not in found  # ratio 1: no gate
    assert "layers.4.attn.indexer.wk.weight" not in found  # Reindex: keys come from layer 3


def test_loader_takes_every_tensor_at_the_configs_fp8_blocks(ckpt, tmp_path):
    ck = load(ckpt)  # fails on any unmapped tensor, unfilled parameter or missing scale
    f = SafetensorsFile(ckpt / "model-layer000.safetensors")
    codes, scales = f.view("layers.0.attn.wq_a.weight"), f.view("layers.0.attn.wq_a.scale")
    full = np.repeat(np.repeat(scales.astype(np.float32), 32, 0), 32, 1)[:codes.shape[0], :codes.shape[1]]
    want = e4m3_to_float32(codes) * full
    got = np.asarray(ck.params["params"]["layers_0"]["attn"]["wq_a"]["weight"])
    np.testing.assert_array_equal(got, want)
    x = np.random.default_rng(0).standard_normal((codes.shape[1], 256)).astype(np.float32)
    assert 0.5 < float(np.std(got @ x)) < 2.0  # unit gain, as a trained projection
    w1 = np.asarray(f.view("layers.0.ffn.experts.5.w1.weight")).view(np.uint8)
    bank = ck.experts.bank["gate_up_blocks"]  # row = layer * E + expert
    np.testing.assert_array_equal(np.asarray(bank[5, :w1.shape[0]]).reshape(w1.shape), w1)

    broken = tmp_path / "no-block"  # without weight_block_size the scales read as 128 x 128
    shutil.copytree(ckpt, broken)
    cfg = json.loads((broken / "config.json").read_text())
    del cfg["quantization_config"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="scale"):
        load(broken)


def test_engine_decodes_and_replays_recorded_routing(ckpt):
    engine = tidejax.load(ckpt, engine={"lanes": 1, "max_context": 64, "prefill_chunk": 16})
    assert engine.family.name == "deepseek_v41"
    t = json.loads((ckpt / "config.json").read_text())["text_config"]
    # KV sources 1, 2 (ratio 2) and 3 (ratio 1, owns indexer keys), float32
    assert engine.cache_bytes_per_token() == 4 * (2 * (64 + 32) / 2 + (64 + 32))
    ids = engine.tokenizer.encode((traces.HELDOUT / "en.txt").read_text())[:12]
    out = []
    engine.scheduler.submit(GenerationRequest(ids, 4, ignore_eos=True),
                            lambda e: out.append(e.token_id) if isinstance(e, TokenEvent) else None)
    engine.scheduler.run_until_idle()
    assert len(out) == 4 and all(0 <= tok < t["vocab_size"] for tok in out)

    n_layers, n_experts, top_k = roofline.moe_dims(ckpt)  # from the nested text_config
    assert (n_layers, n_experts, top_k) == (5, t["n_routed_experts"], t["num_experts_per_tok"])
    picks = traces.scale(traces.load("en"), n_layers, n_experts, top_k)
    engine.set_routing_replay(picks)
    before = np.asarray(engine.state.experts.counts).copy()
    assert np.isfinite(engine.logits(ids)).all()
    want = np.stack([np.bincount(picks[:len(ids), layer].reshape(-1), minlength=n_experts)
                     for layer in range(n_layers)])
    np.testing.assert_array_equal(np.asarray(engine.state.experts.counts) - before, want)
