"""The bundled demo model (models/demo) and the tools that make it (tools/corpus.py,
tools/tokenizer.py, tools/train_demo.py)."""

import json
from pathlib import Path

import numpy as np
import pytest

from tidejax.checkpoint import CheckpointReader
from tools import corpus, demo_stats, train_demo
from tools.corpus import HELDOUT_DIR as HELDOUT

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "models" / "demo"
DOMAINS = ["de", "en", "fr", "man", "python"]


def test_heldout_split_is_disjoint_and_stable():
    docs = [f"document {i}\n\n" + "word " * (i % 37 + 5) for i in range(300)]
    train, test = corpus.split_heldout(docs, 2000)
    assert 2000 <= sum(map(len, test)) < 2000 + max(map(len, docs))
    assert set(train).isdisjoint(test) and len(train) + len(test) == len(docs)
    assert corpus.split_heldout(list(reversed(docs)), 2000)[1] == list(reversed(test))
    assert all(len(c) < 3 * corpus.CHUNK for c in corpus.chunks("\n\n".join(docs)))


def test_demo_directory():
    files = {p.name for p in DEMO.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json"} <= files
    assert sum(p.stat().st_size for p in DEMO.iterdir()) <= 30_000_000
    cfg = json.loads((DEMO / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3"
    assert 32 <= cfg["n_routed_experts"] <= 64 and cfg["n_shared_experts"] == 1
    assert cfg["num_nextn_predict_layers"] == 1
    index = json.loads((DEMO / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in index
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in index
    mtp = "model.layers.4."  # the MTP layer, DeepSeek-V3's names
    assert {mtp + "eh_proj.weight", mtp + "shared_head.norm.weight",
            mtp + f"mlp.experts.{cfg['n_routed_experts'] - 1}.down_proj.weight"} <= set(index)
    for d in DOMAINS:
        assert 20_000 < len((HELDOUT / f"{d}.txt").read_text(encoding="utf-8")) < 100_000


def from_pretrained(path: Path):
    """transformers' DeepseekV3ForCausalLM of `path` in float32, and its loading info; the MTP
    layer's tensors are skipped as transformers skips the published model's (its ignore pattern
    names V3's layer 61: here the layer after the last)."""
    from unittest import mock

    import torch
    from transformers import DeepseekV3ForCausalLM

    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    with mock.patch.object(DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected",
                           [rf"model\.layers\.{n}\..*"]):
        return DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     output_loading_info=True)


def test_chat_template_with_transformers():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bonjour !"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|system|>Be brief.<|end|>\n<|user|>Bonjour !<|end|>\n<|assistant|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id == 0 and tok.convert_ids_to_tokens(ids[-1]) == "<|assistant|>"
    assert tok("Hallo")["input_ids"][0] == tok.bos_token_id  # plain text starts like training documents
    assert tok.decode(tok("def f(x):\n    return 'ü'")["input_ids"], skip_special_tokens=True) == \
        "def f(x):\n    return 'ü'"


# small enough to load and compile quickly; the prompts here are short
ENGINE = {"lanes": 1, "max_context": 128, "page_size": 16, "prefill_chunk": 64, "warmup": False}


@pytest.fixture(scope="module")
def plain():
    """The demo model served without speculation."""
    import tidejax

    engine = tidejax.load(DEMO, engine=ENGINE)
    yield engine
    engine.close()


def test_demo_matches_transformers(plain):
    """tidejax and transformers' DeepseekV3ForCausalLM agree on the shipped checkpoint."""
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    ids = []
    for d in ("en", "python"):
        ids += tok.encode((HELDOUT / f"{d}.txt").read_text(encoding="utf-8")[:120]).ids[:20]
    model, info = from_pretrained(DEMO)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        ref = model.eval()(torch.tensor([ids])).logits[0].numpy()
    ours = plain.logits(ids)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=2e-3 * np.abs(ref).max(), rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.95


def test_tiny_training_loss_falls(tmp_path):
    """A few CPU steps of the toy size on the held-out texts: the loss falls, the export loads."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    arrays = {}
    for d in DOMAINS:
        ids = np.asarray(tok.encode((HELDOUT / f"{d}.txt").read_text(encoding="utf-8")[:30_000]).ids, np.uint16)
        arrays[f"train/{d}"], arrays[f"heldout/{d}"] = ids[:-300], ids[-300:]
    np.savez(tmp_path / "tokens.npz", **arrays)
    out = tmp_path / "tiny"
    train_demo.main(["train", "--tiny", "--data", str(tmp_path / "tokens.npz"), "--tokenizer", str(DEMO),
             "--out", str(out), "--steps", "60", "--seq", "64", "--rows-per-domain", "2",
             "--warmup", "5", "--lr", "3e-3", "--log-every", "10", "--shard-mb", "0.4"])
    log = json.loads((out / "training_log.json").read_text())
    first, last = log["history"][0]["loss"], log["history"][-1]["loss"]
    assert last < first - 0.3, log["history"]
    assert max(log["heldout_loss_fp32"].values()) < np.log(4096) - 0.3

    _, info = from_pretrained(out)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert (out / "model.safetensors.index.json").exists()  # --shard-mb 0.4 splits 0.9 MB

    # the mtp stage on it (its learning shows on the demo: test_demo_mtp_layer_drafts_in_the_engine;
    # this toy predicts little more than unigrams): the layer in DeepSeek-V3's names, the main
    # weights written back unchanged
    with_mtp = tmp_path / "mtp"
    train_demo.main(["mtp", "--data", str(tmp_path / "tokens.npz"), "--model", str(out),
                     "--out", str(with_mtp), "--steps", "4", "--seq", "32", "--rows-per-domain",
                     "2", "--warmup", "2", "--lr", "3e-3", "--log-every", "2", "--shard-mb", "0.4"])
    log = json.loads((with_mtp / "training_log.json").read_text())
    assert log["history"][0]["loss"] == first  # the main model's curve kept beside the MTP's
    assert [h["step"] for h in log["mtp"]["history"]] == [2, 4]
    held = log["mtp"]["heldout"].values()
    assert max(x["loss"] for x in held) < np.log(4096) - 0.3
    assert all(0 < x["sampled_acceptance"] <= 1 for x in held)
    _, info = from_pretrained(with_mtp)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    main, added = CheckpointReader(out, progress=False), CheckpointReader(with_mtp, progress=False)
    layer = f"model.layers.{json.loads((out / 'config.json').read_text())['num_hidden_layers']}."
    assert {n for n in added.names() if not n.startswith(layer)} == set(main.names())
    assert any(n.startswith(layer + "mlp.experts.") for n in added.names())
    for name in main.names():
        np.testing.assert_array_equal(added.read(name), main.read(name))


def test_demo_stats_measures():
    assert demo_stats.share_for(np.array([10.0, 0, 0, 0])) == 0.25
    assert demo_stats.share_for(np.array([1.0, 1, 1, 1])) == 1.0  # 3 of 4 make 75% < 90%
    assert demo_stats.share_for(np.array([50.0, 40, 5, 5])) == 0.5
    assert demo_stats.hot_set(np.array([3.0, 9, 1, 7]), 2) == {1, 3}


def test_demo_mtp_layer_drafts_in_the_engine(plain):
    """The demo's MTP layer (tools/train_mtp.py) drafts on held-out text through the engine
    ([speculative] method "mtp", k = 2): greedy output equals the engine's without speculation,
    token for token, and drafts were accepted."""
    from tokenizers import Tokenizer

    import tidejax
    from tests.support.engine_probes import serve

    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    prompt = tok.encode((HELDOUT / "en.txt").read_text(encoding="utf-8")[:400]).ids[:48]
    speculating = tidejax.load(DEMO, engine=ENGINE, speculative={"method": "mtp", "tokens": 2})
    try:
        got, stats = serve(speculating, prompt, 32)
    finally:
        speculating.close()
    print(f"accepted {stats['accepted_tokens']} of {stats['drafted_tokens']} drafts")
    assert got == serve(plain, prompt, 32)[0]
    assert 0 < stats["accepted_tokens"] <= stats["drafted_tokens"]
