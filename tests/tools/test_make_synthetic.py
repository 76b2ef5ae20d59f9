"""tools/make_synthetic.py writes each family's tensors as its declaration and checkpoint table
name them (tools/synthetic_layout.py). For every shape, on a few layers and experts: the tensors
(shard, name, dtype, shape) are those the hand-written lists of the generator before it wrote
(tests/data/synthetic_headers.json, recorded from it), and the loader's header checks take them
(every tensor mapped, every declared param and expert filled, FP8 / MXFP4 / FP4 pairs and scale
shapes right) without reading any data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidejax.checkpoint import CheckpointReader, fp8
from tidejax.checkpoint.table import _Plan
from tidejax.models.base import abstract
from tools import make_synthetic
from tools.synthetic_layout import Declared, Layout, flatten

HEADERS = json.loads((Path(__file__).parents[1] / "data" / "synthetic_headers.json").read_text())


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_tensors_are_the_published_layout_and_load(case, tmp_path):
    args = make_synthetic.parse_args([str(tmp_path), *case.split()])
    cfg, shards, _ = make_synthetic.plan(args)
    written = sorted(f"{file} {name} {make_synthetic.ST_DTYPES[dtype]} {list(shape)}"
                     for file, tensors in shards for name, dtype, shape, _ in tensors)
    assert written == HEADERS[case]
    make_synthetic.write_headers(tmp_path, shards)  # the data left unwritten (sparse files)
    declared = Declared.of(cfg)
    reader = CheckpointReader(tmp_path, fp8_block=fp8.config_block(cfg),
                              fp8_blocks=declared.table.fp8_blocks)
    plan = _Plan(reader, declared.table, abstract(declared.params), abstract(declared.experts),
                 abstract(declared.host))
    assert set(plan.params) == {path for path, _ in flatten(declared.params | declared.host)}
    assert len(plan.rows) == declared.experts["gate_up"].shape[0]


def test_a_table_that_gives_a_param_two_names_needs_a_preference():
    args = make_synthetic.parse_args(["out", "--shape", "ds41-tiny", "--layers", "1"])
    cfg, _, _ = make_synthetic.plan(args)
    declared = Declared.of(cfg)
    assert declared.table.param_names(("lm_head",)) == ["lm_head.weight", "head.weight"]
    with pytest.raises(ValueError, match=r"params \('lm_head',\).*Layout.prefer must pick one"):
        declared.name(("lm_head",), Layout())


def test_experts_published_per_expert_are_written_bf16_only():
    args = make_synthetic.parse_args(["out", "--shape", "mixtral-8x7b", "--layers", "1",
                                      "--experts", "mxfp4"])
    with pytest.raises(ValueError, match="published per expert in BF16"):
        make_synthetic.plan(args)


def test_mtp_layers_are_written_as_published_and_pooled_in_mxfp4(tmp_path):
    """--mtp-layers 1 writes the NextN layer as published (its experts per expert in BF16) beside
    the main model's MXFP4 experts, and a pool held as stored (MXFP4) quantizes an MTP row as it
    is put (mtp_expert_row's float row; the engine drafting on it: tests/bench's verify_step)."""
    import numpy as np

    from tidejax.checkpoint import mxfp4
    from tidejax.models.loading import ExpertPool

    assert make_synthetic.main([str(tmp_path), "--tiny", "--mtp-layers", "1"]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    reader = CheckpointReader(tmp_path, progress=False)
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight",
            "model.layers.3.shared_head.norm.weight",
            "model.layers.3.mlp.experts.15.down_proj.weight"} <= set(reader.names())
    row = {"gate_up": np.concatenate([reader.read(f"model.layers.3.mlp.experts.5.{p}_proj.weight")
                                      for p in ("gate", "up")]).astype(np.float32),
           "down": reader.read("model.layers.3.mlp.experts.5.down_proj.weight").astype(np.float32)}
    pool = ExpertPool(2, "checkpoint", np.float32)
    packed = {f"{k}_{part}": v for k, w in row.items()
              for part, v in zip(("blocks", "scales"), mxfp4.quantize(np.zeros_like(w)))}
    pool.put_row(0, packed)  # the main model's rows come first, in MXFP4
    pool.put_row(1, row)
    for name in ("gate_up", "down"):
        blocks, scales = mxfp4.quantize(row[name])
        np.testing.assert_array_equal(pool.result()[f"{name}_blocks"][1], blocks)
        np.testing.assert_array_equal(pool.result()[f"{name}_scales"][1], scales)


def test_mtp_layers_refused_for_a_family_that_drafts_nothing(tmp_path):
    args = make_synthetic.parse_args([str(tmp_path), "--shape", "qwen3-tiny", "--mtp-layers", "1"])
    with pytest.raises(SystemExit, match="--mtp-layers: --shape qwen3-tiny's family drafts nothing"):
        make_synthetic.plan(args)
