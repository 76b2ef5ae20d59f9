"""tools/make_gguf.py on tiny synthetic checkpoints, read back with gguf-py's own GGUFReader:
llama.cpp's deepseek2 tensor names and shapes (src/models/deepseek2.cpp), byte totals, values
(gguf-py's MXFP4 dequantization equal to ours, bf16 bit-equal, kv_b split per head), hparams
and the gpt2 vocabulary; and the glm-tiny shape as llama.cpp's glm4moe (src/models/glm4-moe.cpp:
its keys, names, shapes, types and every value)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[2]

from tidejax.errors import CheckpointError, ConfigError
from tidejax.checkpoint import CheckpointReader, mxfp4
from tools import make_gguf
from tools.corpus import HELDOUT_DIR

BF16 = np.dtype(ml_dtypes.bfloat16)
# the tiny shape (tools/make_synthetic.py --tiny): 3 layers, the first dense
D, FF, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V = 64, 128, 2, 32, 32, 16, 8, 16
E, TOP_K, FF_EXP, VOCAB = 16, 4, 32, 4096


def synthetic(out: Path, *args: str, shape: tuple[str, ...] = ("--tiny",)) -> Path:
    subprocess.run([sys.executable, "-m", "tools.make_synthetic", str(out), *shape,
                    "--workers", "1", *args], cwd=REPO, check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(checkpoint dir, its CheckpointReader, GGUFReader of its GGUF, (ours, GGUF) tensor bytes)."""
    root = tmp_path_factory.mktemp("gguf")
    model = synthetic(root / "tiny", "--router-skew")  # correction biases that are not all 0
    totals = make_gguf.write(model, root / "tiny.gguf", progress=False)
    return (model, CheckpointReader(model, progress=False),
            gguf.GGUFReader(root / "tiny.gguf"), totals)


def tensors(reader) -> dict:
    return {t.name: t for t in reader.tensors}


def field(reader, key):
    return reader.fields[key].contents()


def test_ggml_repack_puts_values_j_and_j_plus_16_in_byte_j():
    codes = np.arange(32, dtype=np.uint8) % 16  # value k has code k mod 16
    ours = (codes[0::2] | (codes[1::2] << 4))[None, :]  # byte j: values 2j, 2j + 1
    out = make_gguf.ggml_mxfp4(ours, np.array([130], np.uint8))
    assert out[0] == 130  # the scale leads the block
    np.testing.assert_array_equal(out[1:], np.arange(16, dtype=np.uint8) * 0x11)  # j | j << 4


def test_tensor_names_and_shapes_are_llamacpps(written):
    _, _, reader, _ = written
    # ggml order (fastest axis first), as src/models/deepseek2.cpp creates them
    want = {"token_embd.weight": [D, VOCAB], "output_norm.weight": [D], "output.weight": [D, VOCAB]}
    for i in range(3):
        b = f"blk.{i}"
        want |= {f"{b}.attn_norm.weight": [D], f"{b}.attn_q_a_norm.weight": [Q_LORA],
                 f"{b}.attn_kv_a_norm.weight": [KV_LORA], f"{b}.attn_q_a.weight": [D, Q_LORA],
                 f"{b}.attn_q_b.weight": [Q_LORA, HEADS * (NOPE + ROPE)],
                 f"{b}.attn_kv_a_mqa.weight": [D, KV_LORA + ROPE],
                 f"{b}.attn_k_b.weight": [NOPE, KV_LORA, HEADS],
                 f"{b}.attn_v_b.weight": [KV_LORA, V, HEADS],
                 f"{b}.attn_output.weight": [HEADS * V, D], f"{b}.ffn_norm.weight": [D]}
        if i == 0:
            want |= {f"{b}.ffn_gate.weight": [D, FF], f"{b}.ffn_up.weight": [D, FF],
                     f"{b}.ffn_down.weight": [FF, D]}
        else:
            want |= {f"{b}.ffn_gate_inp.weight": [D, E], f"{b}.exp_probs_b.bias": [E],
                     f"{b}.ffn_gate_exps.weight": [D, FF_EXP, E],
                     f"{b}.ffn_up_exps.weight": [D, FF_EXP, E],
                     f"{b}.ffn_down_exps.weight": [FF_EXP, D, E],
                     f"{b}.ffn_gate_shexp.weight": [D, FF_EXP], f"{b}.ffn_up_shexp.weight": [D, FF_EXP],
                     f"{b}.ffn_down_shexp.weight": [FF_EXP, D]}
    got = {name: [int(n) for n in t.shape] for name, t in tensors(reader).items()}
    assert got == want
    types = {name: t.tensor_type.name for name, t in tensors(reader).items()}
    assert {n for n, q in types.items() if q == "MXFP4"} == {
        f"blk.{i}.ffn_{p}_exps.weight" for i in (1, 2) for p in ("gate", "up", "down")}
    assert {n for n, q in types.items() if q == "F32"} == {
        n for n, s in want.items() if len(s) == 1 or n.endswith("ffn_gate_inp.weight")}


def test_bytes_are_the_checkpoints_but_the_widened_f32(written):
    model, ckpt, reader, (ours, theirs) = written
    stored = sum(int(np.prod(ckpt.shape(n))) * ckpt.dtype(n).itemsize for n in ckpt.names())
    widened = sum(int(np.prod(ckpt.shape(n))) for n in ckpt.names() if ckpt.dtype(n) == BF16
                  and (len(ckpt.shape(n)) == 1 or n.endswith("mlp.gate.weight")))
    assert widened > 0 and ours == stored
    assert theirs == sum(int(t.n_bytes) for t in reader.tensors) == stored + 2 * widened
    print(f"checkpoint {stored:,} bytes, GGUF {theirs:,} bytes")


def test_experts_dequantize_in_gguf_py_as_in_ours(written):
    _, ckpt, reader, _ = written
    ggufs = tensors(reader)
    for i in (1, 2):
        blocks, scales = ckpt.read_mxfp4(f"model.layers.{i}.mlp.experts.gate_up_proj")
        ours = mxfp4.dequantize(blocks, scales)  # [E, 2 * FF_EXP, D]
        for part, rows in (("gate", slice(0, FF_EXP)), ("up", slice(FF_EXP, None))):
            t = ggufs[f"blk.{i}.ffn_{part}_exps.weight"]
            theirs = gguf.quants.dequantize(t.data, t.tensor_type)
            assert theirs.shape == (E, FF_EXP, D)
            np.testing.assert_array_equal(theirs, ours[:, rows])
        blocks, scales = ckpt.read_mxfp4(f"model.layers.{i}.mlp.experts.down_proj")
        t = ggufs[f"blk.{i}.ffn_down_exps.weight"]
        np.testing.assert_array_equal(gguf.quants.dequantize(t.data, t.tensor_type),
                                      mxfp4.dequantize(blocks, scales))


def test_dense_tensors_bit_equal_and_kv_b_split_per_head(written):
    _, ckpt, reader, _ = written
    ggufs = tensors(reader)

    def values(name):
        t = ggufs[name]
        dtype = {"BF16": BF16, "F32": np.float32}[t.tensor_type.name]
        return t.data.view(dtype).reshape([int(n) for n in reversed(t.shape)])

    np.testing.assert_array_equal(values("token_embd.weight").view(np.uint16),
                                  ckpt.read("model.embed_tokens.weight").view(np.uint16))
    np.testing.assert_array_equal(values("blk.1.attn_q_b.weight").view(np.uint16),
                                  ckpt.read("model.layers.1.self_attn.q_b_proj.weight").view(np.uint16))
    np.testing.assert_array_equal(values("blk.2.ffn_gate_inp.weight"),
                                  ckpt.read("model.layers.2.mlp.gate.weight").astype(np.float32))
    for i in (1, 2):  # the routers' correction biases (--router-skew: 5 of 16 above 0)
        bias = ckpt.read(f"model.layers.{i}.mlp.gate.e_score_correction_bias")
        assert np.count_nonzero(bias) == 5
        np.testing.assert_array_equal(values(f"blk.{i}.exp_probs_b.bias"), bias)
    for i in range(3):
        kv_b = ckpt.read(f"model.layers.{i}.self_attn.kv_b_proj.weight")  # [H * (NOPE + V), KV_LORA]
        k_b, v_b = values(f"blk.{i}.attn_k_b.weight"), values(f"blk.{i}.attn_v_b.weight")
        for h in range(HEADS):
            rows = kv_b[h * (NOPE + V):(h + 1) * (NOPE + V)]  # head h: its key rows, then value rows
            np.testing.assert_array_equal(k_b[h].view(np.uint16), rows[:NOPE].T.view(np.uint16))
            np.testing.assert_array_equal(v_b[h].view(np.uint16), rows[NOPE:].view(np.uint16))


def test_hparams_are_the_configs(written):
    model, _, reader, _ = written
    cfg = json.loads((model / "config.json").read_text())
    a = "deepseek2"
    want = {
        "general.architecture": a, f"{a}.block_count": 3, f"{a}.context_length": 16384,
        f"{a}.embedding_length": D, f"{a}.feed_forward_length": FF,
        f"{a}.attention.head_count": HEADS, f"{a}.attention.head_count_kv": 1,
        f"{a}.leading_dense_block_count": 1, f"{a}.vocab_size": VOCAB,
        f"{a}.attention.q_lora_rank": Q_LORA, f"{a}.attention.kv_lora_rank": KV_LORA,
        f"{a}.attention.key_length": KV_LORA + ROPE, f"{a}.attention.value_length": KV_LORA,
        f"{a}.attention.key_length_mla": NOPE + ROPE, f"{a}.attention.value_length_mla": V,
        f"{a}.rope.dimension_count": ROPE, f"{a}.expert_count": E,
        f"{a}.expert_used_count": TOP_K, f"{a}.expert_shared_count": 1,
        f"{a}.expert_feed_forward_length": FF_EXP, f"{a}.expert_weights_norm": True,
        f"{a}.expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID),
        f"{a}.expert_group_count": 1, f"{a}.expert_group_used_count": 1,
    }
    assert {k: field(reader, k) for k in want} == want
    assert field(reader, f"{a}.rope.freq_base") == cfg["rope_theta"]
    assert field(reader, f"{a}.expert_weights_scale") == cfg["routed_scaling_factor"]
    assert field(reader, f"{a}.attention.layer_norm_rms_epsilon") == pytest.approx(
        cfg["rms_norm_eps"], rel=1e-6)
    assert not any("rope.scaling" in k for k in reader.fields)  # the config has no rope_scaling


def test_vocab_is_the_demo_tokenizers_as_gpt2_bpe(written):
    model, _, reader, _ = written
    tok = json.loads((model / "tokenizer.json").read_text())
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == "gpt-2"
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == VOCAB and len(field(reader, "tokenizer.ggml.merges")) == len(
        tok["model"]["merges"])
    assert all(tokens[i] == t for t, i in tok["model"]["vocab"].items())
    types = field(reader, "tokenizer.ggml.token_type")
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    assert {i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL} == special
    assert all(t == gguf.TokenType.NORMAL for i, t in enumerate(types) if i not in special)
    assert field(reader, "tokenizer.ggml.merges")[0] == " ".join(tok["model"]["merges"][0])
    assert (field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.eos_token_id"),
            field(reader, "tokenizer.ggml.add_bos_token")) == (0, 1, True)


def test_bf16_experts_are_refused_naming_the_tensor(tmp_path):
    model = synthetic(tmp_path / "bf16", "--experts", "bf16")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.\w+_proj' is not MXFP4"):
        make_gguf.write(model, tmp_path / "bf16.gguf", progress=False)


# -- GLM-4.5 as glm4moe ----------------------------------------------------------------------------

# the glm-tiny shape (tools/make_synthetic.py --shape glm-tiny --layers 3): the first layer dense
G_HEADS, G_KV, G_DIM, G_ROT = 4, 2, 16, 8  # heads, KV heads, head_dim, rotary channels (factor 0.5)


def randomize_vectors(model: Path, seed: int = 0) -> int:
    """Overwrites every 1-D BF16 tensor of the checkpoint's shards (norms of 1, biases of 0 as
    make_synthetic writes them) with distinct random values, in place; returns how many."""
    rng, count = np.random.default_rng(seed), 0
    for shard in sorted(model.glob("*.safetensors")):
        with open(shard, "r+b") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            for name, info in header.items():
                if name != "__metadata__" and info["dtype"] == "BF16" and len(info["shape"]) == 1:
                    f.seek(8 + size + info["data_offsets"][0])
                    f.write(rng.standard_normal(info["shape"][0]).astype(BF16).tobytes())
                    count += 1
    return count


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(checkpoint dir, its CheckpointReader, GGUFReader of its GGUF, (ours, GGUF) tensor bytes);
    its norms and biases random, so that a bias or norm in the wrong place shows."""
    root = tmp_path_factory.mktemp("glm")
    model = synthetic(root / "glm", "--router-skew",
                      shape=("--shape", "glm-tiny", "--layers", "3"))
    # per layer: 2 norms, q / k norm, q / k / v biases; and the final norm
    assert randomize_vectors(model) == 3 * 7 + 1
    totals = make_gguf.write(model, root / "glm.gguf", progress=False)
    return (model, CheckpointReader(model, progress=False),
            gguf.GGUFReader(root / "glm.gguf"), totals)


def glm_sources() -> dict[str, str]:
    """GGUF tensor -> the checkpoint tensor it holds, as llama.cpp's glm4moe names them (the
    dense and 1-D ones; the experts are checked apart)."""
    out = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    for i in range(3):
        b, m = f"blk.{i}", f"model.layers.{i}"
        out |= {f"{b}.attn_norm.weight": f"{m}.input_layernorm.weight",
                f"{b}.post_attention_norm.weight": f"{m}.post_attention_layernorm.weight",
                f"{b}.attn_output.weight": f"{m}.self_attn.o_proj.weight",
                f"{b}.attn_q_norm.weight": f"{m}.self_attn.q_norm.weight",
                f"{b}.attn_k_norm.weight": f"{m}.self_attn.k_norm.weight"}
        out |= {f"{b}.attn_{p}.{kind}": f"{m}.self_attn.{p}_proj.{kind}"
                for p in "qkv" for kind in ("weight", "bias")}
        if i == 0:
            out |= {f"{b}.ffn_{p}.weight": f"{m}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        else:
            out |= {f"{b}.ffn_{p}_shexp.weight": f"{m}.mlp.shared_experts.{p}_proj.weight"
                    for p in ("gate", "up", "down")}
            out |= {f"{b}.ffn_gate_inp.weight": f"{m}.mlp.gate.weight",
                    f"{b}.exp_probs_b.bias": f"{m}.mlp.gate.e_score_correction_bias"}
    return out


def test_glm_hparams_are_llamacpps_glm4moe_keys(glm):
    model, _, reader, _ = glm
    cfg = json.loads((model / "config.json").read_text())
    a = "glm4moe"
    assert field(reader, "general.architecture") == a
    # what llama.cpp's glm4moe cannot load without (read without a default in llama-model.cpp's
    # load_hparams or glm4-moe.cpp's, or asserted above 0: the expert counts)
    needed = {"context_length", "embedding_length", "block_count", "expert_feed_forward_length",
              "attention.layer_norm_rms_epsilon", "expert_count", "expert_used_count",
              "expert_shared_count"}
    assert {f"{a}.{k}" for k in needed} <= reader.fields.keys()
    want = {
        "block_count": 3, "context_length": 16384, "embedding_length": D,
        "feed_forward_length": FF, "attention.head_count": G_HEADS,
        "attention.head_count_kv": G_KV, "attention.key_length": G_DIM,
        "attention.value_length": G_DIM, "rope.dimension_count": G_ROT,
        "leading_dense_block_count": 1, "vocab_size": VOCAB, "expert_count": E,
        "expert_used_count": TOP_K, "expert_shared_count": 1,
        "expert_feed_forward_length": FF_EXP, "expert_weights_norm": True,
        "expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID),
        "nextn_predict_layers": 0,
        "rope.freq_base": cfg["rope_theta"], "expert_weights_scale": cfg["routed_scaling_factor"],
        "attention.layer_norm_rms_epsilon": pytest.approx(cfg["rms_norm_eps"], rel=1e-6),
    }
    # every key of the architecture, none else (no group counts, no rope scaling, no MLA keys)
    got = {k.removeprefix(f"{a}."): field(reader, k) for k in reader.fields if k.startswith(a + ".")}
    assert got == want
    assert (cfg["rope_theta"], cfg["routed_scaling_factor"], cfg["head_dim"]) == (1e6, 2.5, G_DIM)
    assert field(reader, "tokenizer.ggml.model") == "gpt2"


def test_glm_tensor_names_shapes_and_types_are_llamacpps(glm):
    _, _, reader, _ = glm
    q, kv = G_HEADS * G_DIM, G_KV * G_DIM
    # ggml order (fastest axis first), as src/models/glm4-moe.cpp creates them
    want = {"token_embd.weight": [D, VOCAB], "output_norm.weight": [D], "output.weight": [D, VOCAB]}
    for i in range(3):
        b = f"blk.{i}"
        want |= {f"{b}.attn_norm.weight": [D], f"{b}.attn_q.weight": [D, q],
                 f"{b}.attn_k.weight": [D, kv], f"{b}.attn_v.weight": [D, kv],
                 f"{b}.attn_q.bias": [q], f"{b}.attn_k.bias": [kv], f"{b}.attn_v.bias": [kv],
                 f"{b}.attn_output.weight": [q, D], f"{b}.attn_q_norm.weight": [G_DIM],
                 f"{b}.attn_k_norm.weight": [G_DIM], f"{b}.post_attention_norm.weight": [D]}
        if i == 0:
            want |= {f"{b}.ffn_gate.weight": [D, FF], f"{b}.ffn_up.weight": [D, FF],
                     f"{b}.ffn_down.weight": [FF, D]}
        else:
            want |= {f"{b}.ffn_gate_inp.weight": [D, E], f"{b}.exp_probs_b.bias": [E],
                     f"{b}.ffn_gate_exps.weight": [D, FF_EXP, E],
                     f"{b}.ffn_up_exps.weight": [D, FF_EXP, E],
                     f"{b}.ffn_down_exps.weight": [FF_EXP, D, E],
                     f"{b}.ffn_gate_shexp.weight": [D, FF_EXP],
                     f"{b}.ffn_up_shexp.weight": [D, FF_EXP], f"{b}.ffn_down_shexp.weight": [FF_EXP, D]}
    got = {name: [int(n) for n in t.shape] for name, t in tensors(reader).items()}
    assert got == want
    types = {name: t.tensor_type.name for name, t in tensors(reader).items()}
    assert {n for n, t in types.items() if t == "MXFP4"} == {
        f"blk.{i}.ffn_{p}_exps.weight" for i in (1, 2) for p in ("gate", "up", "down")}
    # norms, biases and routers F32 (llama.cpp adds and normalizes in F32), the rest bf16
    assert {n for n, t in types.items() if t == "F32"} == {
        n for n, s in want.items() if len(s) == 1 or n.endswith("ffn_gate_inp.weight")}
    assert {n for n, t in types.items() if t == "BF16"} == want.keys() - {
        n for n, t in types.items() if t in ("F32", "MXFP4")}


def test_glm_values_are_the_checkpoints(glm):
    """Every GGUF tensor holds its checkpoint tensor as stored: bf16 bit-equal, F32 the bf16
    values widened (the correction bias as its own F32), q and k unpermuted (llama.cpp runs
    glm4moe's rope NEOX-style, rotate-half as tidejax), the experts' MXFP4 dequantizing in
    gguf-py as in ours."""
    _, ckpt, reader, (ours, theirs) = glm
    ggufs = tensors(reader)
    sources = glm_sources()
    assert ggufs.keys() - sources.keys() == {
        f"blk.{i}.ffn_{p}_exps.weight" for i in (1, 2) for p in ("gate", "up", "down")}
    for name, source in sources.items():
        t = ggufs[name]
        stored = ckpt.read(source)
        if t.tensor_type.name == "BF16":
            got = t.data.view(BF16).reshape([int(n) for n in reversed(t.shape)])
            assert stored.dtype == BF16, name
            np.testing.assert_array_equal(got.view(np.uint16), stored.view(np.uint16), err_msg=name)
        else:
            assert t.tensor_type.name == "F32", name
            got = t.data.view(np.float32).reshape([int(n) for n in reversed(t.shape)])
            np.testing.assert_array_equal(got, stored.astype(np.float32), err_msg=name)
    for i in (1, 2):
        assert np.count_nonzero(ckpt.read(f"model.layers.{i}.mlp.gate.e_score_correction_bias")) == 5
        blocks, scales = ckpt.read_mxfp4(f"model.layers.{i}.mlp.experts.gate_up_proj")
        gate_up = mxfp4.dequantize(blocks, scales)  # [E, 2 * FF_EXP, D]: gate rows, then up
        for part, rows in (("gate", slice(0, FF_EXP)), ("up", slice(FF_EXP, None))):
            t = ggufs[f"blk.{i}.ffn_{part}_exps.weight"]
            np.testing.assert_array_equal(gguf.quants.dequantize(t.data, t.tensor_type),
                                          gate_up[:, rows])
        blocks, scales = ckpt.read_mxfp4(f"model.layers.{i}.mlp.experts.down_proj")
        t = ggufs[f"blk.{i}.ffn_down_exps.weight"]
        np.testing.assert_array_equal(gguf.quants.dequantize(t.data, t.tensor_type),
                                      mxfp4.dequantize(blocks, scales))
    widened = sum(int(np.prod(ckpt.shape(n))) for n in ckpt.names() if ckpt.dtype(n) == BF16
                  and (len(ckpt.shape(n)) == 1 or n.endswith("mlp.gate.weight")))
    assert theirs == sum(int(t.n_bytes) for t in reader.tensors) == ours + 2 * widened


@pytest.mark.parametrize("edit, message", [
    ({"attention_bias": False}, "'attention_bias' is false: llama.cpp's glm4moe loads"),
    ({"n_group": 2, "topk_group": 1}, "'n_group' = 2"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 4096}}, "rope_type 'yarn'"),
    ({"model_type": "glm_moe_dsa"}, "make_gguf writes deepseek_v3, deepseek_v2, glm4_moe"),
])
def test_glm_configs_llamacpp_would_run_otherwise_are_refused(glm, tmp_path, edit, message):
    model = shutil.copytree(glm[0], tmp_path / "glm")
    cfg = json.loads((model / "config.json").read_text()) | edit
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_gguf.write(model, tmp_path / "glm.gguf", progress=False)


def test_glm_required_tensors_follow_the_config(glm):
    """A GGUF lacking what the config says tidejax runs (q / k norm with use_qk_norm) or what
    llama.cpp's glm4moe loader requires (the correction bias) is refused, naming the tensor."""
    model, ckpt, reader, _ = glm
    arch, cfg = make_gguf.read_config(model)
    names = set(make_gguf.required(arch, cfg))
    assert names == set(tensors(reader))  # every tensor written is one llama.cpp or the config needs
    for gone in ("blk.1.attn_q_norm.weight", "blk.2.exp_probs_b.bias", "blk.0.attn_v.bias"):
        with pytest.raises(CheckpointError, match=f"no tensor for GGUF {re.escape(gone)}"):
            make_gguf._check_complete(ckpt, arch, cfg, names - {gone})
    without = make_gguf.required(arch, dataclasses.replace(cfg, use_qk_norm=False))
    assert names - set(without) == {f"blk.{i}.attn_{p}_norm.weight" for i in range(3) for p in "qk"}


@pytest.mark.skipif(not os.environ.get("LLAMACPP_BUILD"),
                    reason="set LLAMACPP_BUILD to a llama.cpp build dir with llama-perplexity "
                           "(tools/build_llamacpp.sh build SRC DIR cpu; then --target llama-perplexity)")
@pytest.mark.parametrize("checkpoint", ["written", "glm"])
def test_llamacpp_scores_text_as_tidejax_does(checkpoint, request, tmp_path):
    """llama.cpp's perplexity of held-out text on the GGUF (its own tokenizer, chunks of 128 with
    the second half scored) equals tidejax's on the checkpoint, chunk by chunk: the same model
    (deepseek2 from --tiny, glm4moe from glm-tiny). A GGUF with the MXFP4 nibbles in our order
    instead of GGML's is off by ~4%."""
    import tidejax

    model = request.getfixturevalue(checkpoint)[0]
    text = (HELDOUT_DIR / "en.txt").read_text()[:3000]
    (tmp_path / "en.txt").write_text(text)
    exe = Path(os.environ["LLAMACPP_BUILD"]) / "bin" / "llama-perplexity"
    done = subprocess.run([str(exe), "-m", str(model.parent / f"{model.name}.gguf"), "-f",
                           str(tmp_path / "en.txt"), "-c", "128", "-b", "128", "-t", "2"],
                          check=True, capture_output=True, text=True)
    # the running perplexity after each chunk; its log thread may drop the last ones at exit
    theirs = [float(v) for v in re.findall(r"\[\d+\](\d+\.\d+)", done.stdout)]
    engine = tidejax.load(model, engine={"lanes": 1, "max_context": 256},
                          model={"dtype": "float32"})
    ids = engine.tokenizer.encode(text)  # <|bos|> first, as llama.cpp's add_bos_token says
    nll, count, ours = 0.0, 0, []
    for i in range(len(ids) // 128):
        chunk = [ids[0]] + ids[i * 128 + 1:(i + 1) * 128]  # each chunk starts with <|bos|>
        logits = engine.logits(chunk).astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        nll -= sum(logp[j, chunk[j + 1]] for j in range(64, 127))
        count += 63
        ours.append(float(np.exp(nll / count)))
    print("llama.cpp", theirs, "\ntidejax  ", ours)
    assert len(ours) >= len(theirs) >= 4
    np.testing.assert_allclose(theirs, ours[:len(theirs)], rtol=5e-3)
