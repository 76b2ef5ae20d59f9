"""DeepSeek-V4.1 published formats: the test writes tiny_a in the released layout (no `model.`
prefix, `head.weight`; dense weights FP8 e4m3 with e8m0 128x128 block scales; routed experts FP4
(e2m1 pairs + e8m0 scales per 32); Engram tables FP8 with e8m0 scales per 32 channels), and
checks that loading gives exactly the dequantized values and the same logits as a float
checkpoint of those values."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tidejax.errors import CheckpointError
from tidejax.checkpoint import mxfp4
from tidejax.models.deepseek_v41.weights import load
from tests.support.declaration import edited_copy, forbid_data_reads
from tests.support.v41_published import E4M3, GOLDEN
from tests.support.v41_runner import full_logits


def test_published_formats_load_exactly(published):
    quant, ref = load(published / "fp8"), load(published / "float")
    import jax

    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(quant.params),
                                 jax.tree_util.tree_leaves_with_path(ref.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
    bank, dense = quant.experts.bank, ref.experts.bank  # every layer's experts, [layers * E, ...]
    assert set(bank) == {"gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"}
    for part in ("gate_up", "down"):
        got = mxfp4.dequantize(np.asarray(bank[f"{part}_blocks"]), np.asarray(bank[f"{part}_scales"]))
        assert np.array_equal(got, np.asarray(dense[part])), part
    for (values, scales), table in zip(quant.engram_tables, ref.engram_tables):
        assert values.dtype == E4M3  # stays a memory-mapped fp8 view on the host
        rows = values.astype(np.float32).reshape(len(values), -1, 32) * scales[..., None]
        assert np.array_equal(rows.reshape(table.shape), table)


def test_published_formats_same_logits(published):
    ids = np.load(GOLDEN / "input_ids.npy")[0, :12]
    got = full_logits(load(published / "fp8"), ids, kernel="reference")
    want = full_logits(load(published / "float"), ids, kernel="reference")
    assert np.abs(got - want).max() <= 1e-5


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("layers.0.attn.wq_a.scale"),
     r"FP8 tensor 'layers.0.attn.wq_a.weight' has no .* block scales"),
    (lambda t: t.pop("layers.1.ffn.experts.2.w3.scale"),
     r"tensor 'layers.1.ffn.experts.2.w3.weight' has shape \[32, 32\], the routed experts' 'up'"),
    (lambda t: t.pop("layers.3.engram.embed.scale"),
     r"FP8 tensor 'layers.3.engram.embed.weight' has no .* block scales"),
    (lambda t: t.pop("layers.3.ffn.experts.0.w2.weight"),
     r"missing tensor 'layers.3.ffn.experts.0.w2.weight' .*routed expert\(s\) 0 of layer"),
    (lambda t: t.update({"layers.0.attn.extra": np.zeros(3, np.float32)}),
     r"tensor\(s\) that no rule maps: 'layers.0.attn.extra' in .*model.safetensors"),
    (lambda t: t.update({"norm.weight": np.zeros(5, np.float32)}),
     r"tensor 'norm.weight' has shape \[5\], params \('norm', 'weight'\) expects \[64\]"),
    (lambda t: t.pop("layers.2.attn.wq_b.weight"),
     r"missing tensor 'layers.2.attn.wq_b.weight' \(needed for params"),
])
def test_bad_checkpoint_names_the_tensor(published, tmp_path, edit, message, monkeypatch):
    """Every problem is found on the headers: no tensor data is read before the error."""
    edited = edited_copy(published / "fp8", tmp_path / "edited", edit)
    forbid_data_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=message) as err:
        load(edited)
    assert str(edited) in str(err.value)


def test_bad_config_names_the_file(tmp_path):
    raw = json.loads((GOLDEN / "config.json").read_text())
    raw["text_config"]["compress_ratios"] = [0, 2, 2, -1, 1, 1]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    from tidejax.errors import ConfigError

    with pytest.raises(ConfigError, match=r"config.json: text_config: field 'compress_ratios'\[3\]"):
        load(tmp_path)


def test_experts_to_a_host_pool(published):
    """With put_row the experts go to the caller row by row (layer * E + expert), as residency's
    host pool takes them, in the checkpoint's format; nothing is stacked on the device."""
    rows = {}
    ck = load(published / "fp8", put_row=lambda r, row: rows.__setitem__(r, row))
    ref = load(published / "fp8")
    e = ck.cfg.n_routed_experts
    assert ck.experts is None and sorted(rows) == list(range(ck.cfg.num_layers * e))
    for r, row in rows.items():
        for key, value in row.items():
            assert np.array_equal(value, np.asarray(ref.experts.bank[key][r])), (r, key)
