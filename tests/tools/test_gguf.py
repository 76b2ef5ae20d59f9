"""tools/make_gguf.py on a tiny synthetic checkpoint, read back with gguf-py's own GGUFReader:
llama.cpp's deepseek2 tensor names and shapes (src/models/deepseek2.cpp), byte totals, values
(gguf-py's MXFP4 dequantization equal to ours, bf16 bit-equal, kv_b split per head), hparams
and the gpt2 vocabulary."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[2]

from tidejax.errors import CheckpointError
from tidejax.checkpoint import CheckpointReader, mxfp4
from tools import make_gguf
from tools.corpus import HELDOUT_DIR

BF16 = np.dtype(ml_dtypes.bfloat16)
# the tiny shape (tools/make_synthetic.py --tiny): 3 layers, the first dense
D, FF, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V = 64, 128, 2, 32, 32, 16, 8, 16
E, TOP_K, FF_EXP, VOCAB = 16, 4, 32, 4096


def synthetic(out: Path, *args: str) -> Path:
    subprocess.run([sys.executable, "-m", "tools.make_synthetic", str(out), "--tiny",
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


@pytest.mark.skipif(not os.environ.get("LLAMACPP_BUILD"),
                    reason="set LLAMACPP_BUILD to a llama.cpp build dir with llama-perplexity "
                           "(tools/build_llamacpp.sh build SRC DIR cpu; then --target llama-perplexity)")
def test_llamacpp_scores_text_as_tidejax_does(written, tmp_path):
    """llama.cpp's perplexity of held-out text on the GGUF (its own tokenizer, chunks of 128 with
    the second half scored) equals tidejax's on the checkpoint, chunk by chunk: the same model.
    A GGUF with the MXFP4 nibbles in our order instead of GGML's is off by ~4%."""
    import tidejax

    model, _, _, _ = written
    text = (HELDOUT_DIR / "en.txt").read_text()[:3000]
    (tmp_path / "en.txt").write_text(text)
    exe = Path(os.environ["LLAMACPP_BUILD"]) / "bin" / "llama-perplexity"
    done = subprocess.run([str(exe), "-m", str(model.parent / "tiny.gguf"), "-f",
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
