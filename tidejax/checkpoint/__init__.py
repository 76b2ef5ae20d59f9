"""Checkpoint loading: safetensors (single file or sharded), FP8 and MXFP4, expert layouts, one
idiom: a family declares its params (models.base.ParamSpec) and a regex table that fills them;
this package reads, maps and checks.

    reader = CheckpointReader(model_dir, fp8_block=fp8.config_block(raw_config))  # headers now
    table = Table(rules=(Rule("model.embed_tokens.weight", "embed"), ...,
                         Experts(r"{layer:model\\.layers\\.\\d+\\.mlp}.experts.{expert}."
                                 r"{part:gate|up|down}_proj.weight")),
                  ignore=(r"model.layers.61.{rest:.*}",), expert_layers=("model.layers.1.mlp", ...))
    params = load(reader, table, abstract(param_specs), abstract(expert_specs), put=...,
                  put_row=pool.put_row)

`load` runs every check (unmapped, multi-match, no place, duplicate, shape, unfilled, expert
layouts) on the headers before any data is read (see table.py); the reader checks each file's
header, the index and every FP8 / MXFP4 pair at open (see reader.py). Every error is one
`tidejax.errors.CheckpointError` naming the file and the tensor. `reader.read(name)`,
`read_row(name, row)` and `read_mxfp4(name)` give single tensors; one progress bar (tensors and
bytes) goes to stderr unless `progress=False`.
"""

from tidejax.checkpoint.fp8 import dequantize_fp8_block, quantize_fp8_block
from tidejax.checkpoint.reader import CheckpointReader, Tensor
from tidejax.checkpoint.table import TRANSPOSE, Experts, Rule, Table, Transform, load

__all__ = ["CheckpointReader", "Experts", "Rule", "TRANSPOSE", "Table",
           "Tensor", "Transform", "load", "dequantize_fp8_block", "quantize_fp8_block"]
