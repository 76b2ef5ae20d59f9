"""DeepSeek-V4.1 params, declared (the tree the flax model consumes), the Engram tables (kept
on the host), and the checkpoint table that fills them; loading, test init and memory estimates
come from these declarations.

Names: the reference's module paths (`model.layers.{i}.attn.wq_a.weight`, ...) or the published
ones (no `model.` prefix, `head.weight` for the output head). Formats (CheckpointReader):
- float (f32 / bf16 / f16) tensors as they are;
- FP8 dense weights: `X.weight` float8_e4m3fn + `X.scale` (e8m0, or float32 `X.weight_scale_inv`)
  per block of config.json's `quantization_config.weight_block_size` (the published Flash
  checkpoint: 32 x 32; 128 x 128 when the config does not say);
- FP4 routed experts: `...experts.{e}.w{1,2,3}.weight` uint8/int8 [out, in/2] (two e2m1 codes a
  byte, low nibble first) + `.scale` e8m0 (or uint8 exponents) [out, in/32]: kept as an MXFP4 bank
  {"gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"};
- Engram tables: `engram.embed.weight` float8_e4m3fn + `engram.embed.scale` per 32 channels,
  read as (values, scales) and put in host memory as they are (engram.EngramTables), the rows a
  step names dequantized on the device (float tables as they are; their `.scale`, if any, is
  unused, as in the reference).
Every check (unmapped, unfilled, duplicate, shape, scales) runs on the headers before any data
is read; a problem is one CheckpointError naming the file and the tensor.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from tidejax.checkpoint import Experts, Rule, Table
from tidejax.errors import ConfigError
from tidejax.fields import read_json
from tidejax.models.base import ParamSpec
from tidejax.models.deepseek_v41.config import V41Config
from tidejax.models.deepseek_v41.engram import EngramLayout, EngramTables, compressed_token_map
from tidejax.models.deepseek_v41.model import (ATTN_NAMES, engram_specs, router_spec,
                                                scanned_runs)
from tidejax.models.layers.latent_window import attention_specs
from tidejax.models.layers.linear import embedding_specs, linear_specs
from tidejax.models.layers.mhc import mhc_specs
from tidejax.models.layers.moe import moe_specs, routed_expert_specs
from tidejax.models.layers.norm import norm_specs
from tidejax.models.loading import ExpertPool, load_by_table
from tidejax.residency.state import ExpertState, all_resident_state

F32 = jnp.float32


def _attn_specs(cfg: V41Config, layer: int, dtype) -> dict:
    d, k, q = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank
    specs = attention_specs(cfg, ATTN_NAMES, dtype, dtype)
    ratio = cfg.compress_ratios[layer]
    if ratio and layer in cfg.kv_sources:
        specs["compressor"] = {"wkv": linear_specs(k, d, (None, "embed"), dtype),
                               "norm": norm_specs(k, None, dtype)}
        if ratio > 1:
            specs["compressor"]["wgate"] = linear_specs(k, d, (None, "embed"), dtype)
    if ratio and layer in cfg.index_sources:
        ik = cfg.index_head_dim
        specs["indexer"] = {"wq_b": linear_specs(cfg.index_heads * ik, q, (None, "q_lora"), dtype),
                            "weights_proj": linear_specs(cfg.index_heads, d, (None, "embed"), dtype)}
        if cfg.owns_index_keys(layer):
            specs["indexer"] |= {"wk": linear_specs(ik, k, (None, None), dtype),
                                 "k_norm": norm_specs(ik, None, dtype)}
    return specs


def param_specs(cfg: V41Config, dtype) -> dict:
    """The dense params (everything but the routed experts and the Engram tables) as ParamSpecs,
    in `dtype` but for what the reference keeps float32 (ARCHITECTURE.md's parameter dtypes):
    the mHC params, the attention sinks and the routers (weights and correction biases)."""
    d, n = cfg.hidden_size, cfg.hc_mult
    specs = {**embedding_specs(cfg.vocab_size, d, dtype, cfg.tie_word_embeddings),
             "norm": norm_specs(d, "embed", dtype)}
    for i in range(cfg.num_layers):
        layer = {"attn_norm": norm_specs(d, "embed", dtype), "attn": _attn_specs(cfg, i, dtype),
                 "ffn_norm": norm_specs(d, "embed", dtype),
                 "ffn": moe_specs(router_spec(cfg), d, cfg.moe_intermediate_size, dtype),
                 **mhc_specs("hc_attn", n, d), **mhc_specs("hc_ffn", n, d)}
        if i in cfg.engram_layers:
            layer["engram"] = engram_specs(cfg, dtype)
        specs[f"layers_{i}"] = layer
    return specs


def stack_runs(params: dict, runs) -> dict:
    """The loaded params (per layer, as param_specs declares them) with the layers of each
    scanned run ((first, period, repeats): model.scanned_runs) stacked as model.LayerBlock takes
    them: {"layers_{first}_{last}": {"layer_{k}": layers first + j * period + k on a leading
    axis j}}. The per-layer arrays are dropped as each run is stacked."""
    params = dict(params)
    for first, period, repeats in runs:
        params[f"layers_{first}_{first + period * repeats - 1}"] = {
            f"layer_{k}": jax.tree.map(lambda *layers: jnp.stack(layers), *[
                params.pop(f"layers_{first + j * period + k}") for j in range(repeats)])
            for k in range(period)}
    return params


def host_specs(cfg: V41Config) -> dict:
    """The Engram tables, kept on the host as stored: {"engram": {"layers_{i}": [rows, e]}}."""
    return {"engram": {f"layers_{i}": ParamSpec((rows, cfg.engram_head_dim), F32, (None, None))
                       for i, rows in zip(cfg.engram_layers, cfg.engram_num_embeddings)}}


def expert_specs(cfg: V41Config, dtype) -> dict:
    """The routed experts as host-pool rows (layer * n_routed_experts + expert)."""
    n_moe, n_experts, hidden, inter = expert_dims(cfg)
    return routed_expert_specs(n_moe * n_experts, hidden, inter, dtype)


_P = r"{p:(?:model\.)?}"  # the reference's names have it, the published ones do not
_LAYER = _P + "layers.{i}"
_EXPERT = _P + r"{layer:layers\.[0-9]+\.ffn}.experts.{expert}"
RULES = (
    Rule(_P + "embed.weight", "embed"),
    Rule("lm_head.weight", "lm_head"),
    Rule("head.weight", "lm_head"),
    Rule(_P + "norm.weight", "norm.weight"),
    Rule(f"{_LAYER}.{{norm:attn_norm|ffn_norm}}.weight", "layers_{i}.{norm}.weight"),
    Rule(f"{_LAYER}.{{site:hc_attn|hc_ffn}}_{{part:fn|base|scale}}", "layers_{i}.{site}_{part}"),
    Rule(f"{_LAYER}.attn.attn_sink", "layers_{i}.attn.attn_sink"),
    Rule(f"{_LAYER}.attn.wo_a.weight", "layers_{i}.attn.wo_a.weight"),
    Rule(f"{_LAYER}.attn.{{m:wq_a|q_norm|wq_b|wkv|kv_norm|wo_b}}.weight", "layers_{i}.attn.{m}.weight"),
    Rule(f"{_LAYER}.attn.compressor.{{m:wkv|wgate|norm}}.weight",
         "layers_{i}.attn.compressor.{m}.weight"),
    Rule(f"{_LAYER}.attn.indexer.{{m:wq_b|weights_proj|wk|k_norm}}.weight",
         "layers_{i}.attn.indexer.{m}.weight"),
    Rule(f"{_LAYER}.engram.wkv.weight", "layers_{i}.engram.wkv.weight"),
    Rule(f"{_LAYER}.engram.{{m:q_weight|k_weight}}", "layers_{i}.engram.{m}"),
    Rule(f"{_LAYER}.engram.embed.weight", "engram.layers_{i}"),
    Rule(f"{_LAYER}.ffn.gate.weight", "layers_{i}.ffn.gate_weight"),
    Rule(f"{_LAYER}.ffn.gate.bias", "layers_{i}.ffn.gate_bias"),
    # the shared expert is layers.mlp.SwiGLU, named "shared" inside layers.moe.MoE
    Rule(f"{_LAYER}.ffn.shared_experts.w1.weight", "layers_{i}.ffn.shared.gate_proj.weight"),
    Rule(f"{_LAYER}.ffn.shared_experts.w3.weight", "layers_{i}.ffn.shared.up_proj.weight"),
    Rule(f"{_LAYER}.ffn.shared_experts.w2.weight", "layers_{i}.ffn.shared.down_proj.weight"),
    Experts(_EXPERT + ".w1.weight", part="gate"),
    Experts(_EXPERT + ".w3.weight", part="up"),
    Experts(_EXPERT + ".w2.weight", part="down"),
)
# Tensors present in checkpoints that the text forward does not use: image-token router bias,
# DSpark draft layers, the vision tower (no reference forward exists for these yet), and the
# scales of float Engram tables (the reference ignores them).
IGNORED = (f"{_LAYER}.ffn.gate.bias_vl", f"{_LAYER}.engram.embed.scale",
           r"{a:(?:.*\.)?}mtp.{rest:.*}", _P + "vision.{rest:.*}", _P + "aligner.{rest:.*}",
           _P + "image_{what:start|end|newline}")


def checkpoint_table(cfg: V41Config) -> Table:
    """Checkpoint names -> the declared params, the Engram tables (FP8 scales per 32 channels of
    a row) and the routed-expert rows (every layer is a MoE layer)."""
    return Table(RULES, ignore=IGNORED,
                 expert_layers=[f"layers.{i}.ffn" for i in range(cfg.num_layers)],
                 fp8_blocks={f"{_LAYER}.engram.embed.weight": (1, 32)})


@dataclasses.dataclass
class V41Checkpoint:
    cfg: V41Config
    params: dict  # {"params": flax tree}
    experts: ExpertState | None  # every expert resident (None when put_row took the rows)
    engram_tables: list  # per Engram layer: [rows, e] as stored or (e4m3 values, float32 scales)
    engram_layout: EngramLayout | None
    engram: EngramTables | None  # the tables in host memory and the hash maps, for the forward


def load(model_dir, tokenizer=None, *, dtype=jnp.float32, put_row=None,
         dense_format: str = "float") -> V41Checkpoint:
    """Reads config.json, the safetensors checkpoint and (with Engram layers) tokenizer.json of a
    folder, through the checkpoint table.

    dtype: the model's, of the dense params (param_specs). put_row(layer * E + expert, row): where the
    routed experts go (a host pool, for residency); without it they are stacked into an
    all-resident expert state (`V41Checkpoint.experts`), which only suits models that fit.
    dense_format "fp8": the projections stored FP8 (wq_a, wq_b, wkv, wo_a, wo_b, the
    compressors', indexers' and Engram's, the shared experts') stay FP8 on the device
    (loading.fp8_specs)."""
    model_dir = Path(model_dir)
    raw = read_json(model_dir / "config.json")
    cfg = V41Config.from_hf(raw, str(model_dir / "config.json"))
    n_moe, n_experts = expert_dims(cfg)[:2]
    pool = None if put_row is not None else ExpertPool(n_moe * n_experts, "checkpoint", F32)
    params = load_by_table(model_dir, raw, checkpoint_table(cfg), param_specs(cfg, dtype),
                           expert_specs(cfg, F32), put_row or pool.put_row,
                           host_specs=host_specs(cfg), dense_format=dense_format)
    tables = params.pop("engram", {})
    layout = engram_layout(cfg, model_dir, tokenizer) if cfg.engram_layers else None
    experts = None if pool is None else all_resident_state(pool.result(), n_moe)
    tables = [tables[f"layers_{i}"] for i in cfg.engram_layers]
    return V41Checkpoint(cfg, {"params": params}, experts, tables, layout,
                         EngramTables.place(layout, tables, cfg.vocab_size) if layout else None)


def engram_layout(cfg: V41Config, model_dir: Path, tokenizer=None) -> EngramLayout:
    """The hash layout, with the token map derived from the folder's tokenizer.json."""
    if tokenizer is None:
        from tokenizers import Tokenizer

        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ConfigError(f"{path}: Engram layers need the tokenizer to hash n-grams")
        tokenizer = Tokenizer.from_file(str(path))
    return EngramLayout.build(cfg.engram_layers, cfg.engram_max_ngram, cfg.engram_heads,
                              cfg.engram_vocab_size, compressed_token_map(tokenizer),
                              cfg.engram_pad_id, cfg.engram_compressed_vocab,
                              cfg.engram_num_embeddings, cfg.source)


def expert_dims(cfg: V41Config) -> tuple[int, int, int, int]:
    """Every layer is a MoE layer: (layers, experts, hidden, expert intermediate)."""
    return cfg.num_layers, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size


def load_weights(cfg: V41Config, model_dir, raw_config: dict, serve, dtype, put_row,
                 dense_format: str = "float"):
    """The family's loader: (dense params, placed by their declared axes; the checkpoint as the
    aux: its `engram` is what every step's forward takes beside the params)."""
    checkpoint = load(model_dir, dtype=dtype, put_row=put_row, dense_format=dense_format)
    params = stack_runs(checkpoint.params.pop("params"), scanned_runs(cfg, serve))
    return params, checkpoint

