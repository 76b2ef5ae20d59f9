"""DeepSeek-V4.1 params (declared by the model: `param_shapes`) and the loading of a checkpoint
folder: config, dense params (flax tree, float32), routed experts (one bank per layer, or rows
into the engine's pool), Engram tables (host, memory-mapped) and the Engram hash layout (from
the tokenizer).

Names: the reference's module paths (`model.layers.{i}.attn.wq_a.weight`, ...) or the published
ones (no `model.` prefix, `head.weight` for the output head). Formats, told apart by dtype:
- float (f32 / bf16 / f16) tensors as they are;
- FP8 dense weights: `X.weight` float8_e4m3fn + `X.scale` (e8m0, or float32 `X.weight_scale_inv`)
  per block of config.json's `quantization_config.weight_block_size` (the published Flash
  checkpoint: 32 x 32; 128 x 128 when the config does not say);
- FP4 routed experts: `...experts.{e}.w{1,2,3}.weight` uint8/int8 [out, in/2] (two e2m1 codes a
  byte, low nibble first) + `.scale` e8m0 (or uint8 exponents) [out, in/32]: kept as an MXFP4 bank
  {"gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"};
- Engram tables: `engram.embed.weight` float8_e4m3fn + `engram.embed.scale` per 32 channels,
  kept as (values, scales) and dequantized row by row when gathered.
Loading fails on any unmapped tensor, unfilled parameter, missing scale or shape mismatch.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from tidejax import parallel
from tidejax.checkpoint.fp8 import BLOCK, config_block, dequantize_fp8_block
from tidejax.checkpoint.safetensors_io import SafetensorsFile
from tidejax.fields import read_json
from tidejax.models.deepseek_v41.config import V41Config
from tidejax.models.deepseek_v41.engram import EngramLayout, compressed_token_map
from tidejax.models.deepseek_v41.model import DeepseekV41, V41Cache
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import ExpertState, all_resident_state

# Tensors present in checkpoints that the text forward does not use: image-token router bias,
# DSpark draft layers, the vision tower (no reference forward exists for these yet).
IGNORED = (r"\.ffn\.gate\.bias_vl$", r"(^|\.)mtp\.", r"^vision\.", r"^aligner\.",
           r"^image_(start|end|newline)$")
_RENAMES = {("embed", "weight"): ("embed",), ("lm_head", "weight"): ("lm_head",),
            ("head", "weight"): ("lm_head",),
            ("attn", "wo_a", "weight"): ("attn", "wo_a"),
            ("ffn", "gate", "weight"): ("ffn", "gate_weight"),
            ("ffn", "gate", "bias"): ("ffn", "gate_bias"),
            # the shared expert is layers.mlp.SwiGLU, named "shared" inside layers.moe.MoE
            ("shared_experts", "w1", "weight"): ("shared", "gate_proj", "weight"),
            ("shared_experts", "w3", "weight"): ("shared", "up_proj", "weight"),
            ("shared_experts", "w2", "weight"): ("shared", "down_proj", "weight")}
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_ENGRAM = re.compile(r"^layers\.(\d+)\.engram\.embed\.weight$")
_SCALES = (".scale", "_scale_inv")  # suffixes of a weight's block scales: X.scale, X.weight_scale_inv
_PACKED = (np.dtype(np.uint8), np.dtype(np.int8))  # FP4 codes, two a byte


class V41LoadError(ValueError):
    """A checkpoint that does not fit the config; names the file and the tensor."""


def param_path(name: str) -> tuple[str, ...]:
    """Checkpoint tensor name (prefix `model.` stripped) -> flax param path."""
    parts = re.sub(r"^layers\.(\d+)\.", r"layers_\1.", name).split(".")
    for tail, repl in _RENAMES.items():
        if tuple(parts[-len(tail):]) == tail:
            return tuple(parts[:-len(tail)]) + repl
    return tuple(parts)


def param_shapes(cfg: V41Config) -> dict:
    """The flax param tree's shapes (nothing allocated)."""
    model = DeepseekV41(cfg, ServeOptions(kernel="reference", swiglu_limit=cfg.swiglu_limit,
                                          all_resident=True))
    b, t = 1, 1
    cache = V41Cache.create(cfg, b, 4)
    rows = jnp.zeros((b, t, len(cfg.engram_layers), cfg.engram_cols, cfg.engram_head_dim))
    tok = jnp.zeros((b, t), jnp.int32)

    def init():
        experts = all_resident_state(empty_pool(cfg), cfg.num_layers)
        return model.init(jax.random.PRNGKey(0), tok, tok, tok > -1, cache, experts,
                          rows if cfg.engram_layers else None)
    return jax.eval_shape(init)["params"]


def empty_pool(cfg: V41Config) -> dict:
    """A dense pool of every layer's routed experts, zeros: [layers * E, ...]."""
    n, i, d = cfg.num_layers * cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    return {"gate_up": jnp.zeros((n, 2 * i, d), jnp.float32), "down": jnp.zeros((n, d, i), jnp.float32)}


@dataclasses.dataclass
class V41Checkpoint:
    cfg: V41Config
    params: dict  # {"params": flax tree}
    experts: ExpertState | None  # every expert resident (None when put_row took the rows)
    engram_tables: list  # per Engram layer: float32 [rows, e] or (e4m3 values, float32 scales)
    engram_layout: EngramLayout | None


class Tensors:
    """The folder's safetensors files as one lazy name -> array map (memory-mapped views),
    names without the `model.` prefix; records what was used so leftovers can be reported.
    fp8_block: the (rows, cols) block of an FP8 weight's scales."""

    def __init__(self, model_dir: Path, fp8_block: tuple[int, int] = BLOCK):
        self.source, self.fp8_block = model_dir, fp8_block
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise V41LoadError(f"{model_dir}: no *.safetensors file")
        self.where: dict[str, tuple[SafetensorsFile, str]] = {}
        for path in files:
            f = SafetensorsFile(path)
            for name in f.tensors:
                key = name.removeprefix("model.")
                if key in self.where:
                    raise V41LoadError(f"{path}: tensor {name} appears twice in the checkpoint")
                self.where[key] = (f, name)
        self.used: set[str] = set()

    def __contains__(self, name):
        return name in self.where

    def dtype(self, name) -> np.dtype:
        f, raw = self.where[name]
        return f.tensors[raw].dtype

    def shape(self, name) -> tuple:
        f, raw = self.where[name]
        return tuple(f.tensors[raw].shape)

    def view(self, name) -> np.ndarray:
        f, raw = self.where[name]
        self.used.add(name)
        return f.view(raw)

    def where_is(self, name) -> str:
        f, raw = self.where[name]
        return f"{f.path}: tensor {raw}"

    def scale_of(self, name) -> str | None:
        """The block-scale tensor that goes with weight `name`, if any."""
        base = name.removesuffix(".weight")
        for cand in (base + ".scale", name + "_scale_inv"):
            if cand in self.where:
                return cand
        return None

    def read_float(self, name) -> np.ndarray:
        """A float32 copy; FP8 weights are dequantized with their block scales."""
        value = self.view(name)
        if value.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
            return np.asarray(value, np.float32)
        scale = self.scale_of(name)
        if scale is None:
            raise V41LoadError(f"{self.where_is(name)} is FP8 but has no block scales "
                               "(X.scale or X.weight_scale_inv)")
        try:
            return dequantize_fp8_block(value, _as_float(self.view(scale)), self.fp8_block)
        except ValueError as e:
            raise V41LoadError(f"{self.where_is(name)}: {e}") from None


def _as_float(scales: np.ndarray) -> np.ndarray:
    """e8m0 (float8_e8m0fnu, or raw uint8 exponents with bias 127) or float scales -> float32."""
    if scales.dtype == np.uint8:
        return np.ldexp(np.float32(1), scales.astype(np.int32) - 127)
    return scales.astype(np.float32)


def load(model_dir, tokenizer=None, *, dtype=jnp.float32, put_row=None) -> V41Checkpoint:
    """Reads config.json, *.safetensors and (with Engram layers) tokenizer.json of a folder.

    dtype: of the dense params. put_row(layer * E + expert, row): where the routed experts go
    (a host pool, for residency); without it they are stacked into an all-resident expert state
    (`V41Checkpoint.experts`), which only suits models that fit."""
    model_dir = Path(model_dir)
    raw = read_json(model_dir / "config.json")
    cfg = V41Config.from_hf(raw, str(model_dir / "config.json"))
    tensors = Tensors(model_dir, config_block(raw))
    shapes = flatten_dict(param_shapes(cfg))
    params: dict = {}
    experts: dict[int, dict] = {}
    tables: dict[int, object] = {}
    for name in list(tensors.where):
        if any(re.search(p, name) for p in IGNORED) or name.endswith(_SCALES):
            continue
        if m := _EXPERT.match(name):
            experts.setdefault(int(m[1]), {})[(int(m[2]), m[3])] = name
            continue
        if m := _ENGRAM.match(name):
            tables[int(m[1])] = _engram_table(tensors, name)
            continue
        path = param_path(name)
        if path not in shapes:
            raise V41LoadError(f"{tensors.where_is(name)} has no place in the model")
        if tensors.shape(name) != shapes[path].shape:
            raise V41LoadError(f"{tensors.where_is(name)} has shape {tensors.shape(name)}, "
                               f"the config needs {shapes[path].shape}")
        params[path] = jnp.asarray(tensors.read_float(name), dtype)
    missing = [p for p in shapes if p not in params]
    if missing:
        raise V41LoadError(f"{model_dir}: no tensor for parameter {'/'.join(missing[0])} "
                           f"({len(missing)} missing)")
    stacked = []
    for layer in range(cfg.num_layers):
        rows = _expert_rows(tensors, experts.get(layer, {}), layer, cfg)
        if put_row is not None:
            for expert, row in rows:
                put_row(layer * cfg.n_routed_experts + expert, row)
        else:
            stacked += [row for _, row in rows]
    state = None
    if put_row is None:
        pool = {k: np.stack([r[k] for r in stacked]) for k in stacked[0]}
        state = all_resident_state(pool, cfg.num_layers)
    for layer in cfg.engram_layers:
        if layer not in tables:
            raise V41LoadError(f"{model_dir}: no tensor layers.{layer}.engram.embed.weight")
    left = [n for n in tensors.where if n not in tensors.used and not any(
        re.search(p, n) for p in IGNORED)]
    if left:
        raise V41LoadError(f"{tensors.where_is(left[0])} is not used by the model "
                           f"({len(left)} such tensors)")
    layout = engram_layout(cfg, model_dir, tokenizer) if cfg.engram_layers else None
    return V41Checkpoint(cfg, {"params": unflatten_dict(params)}, state,
                         [tables[layer] for layer in cfg.engram_layers], layout)


def _engram_table(tensors: Tensors, name: str):
    """float32 rows, or (e4m3 rows as a memory-mapped view, float32 scales [rows, e/32])."""
    values = tensors.view(name)
    scale = name.removesuffix(".weight") + ".scale"
    if values.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
        if scale in tensors:
            tensors.view(scale)  # float rows: the reference ignores the scales
        return np.asarray(values, np.float32)
    if scale not in tensors or tensors.shape(scale) != (values.shape[0], values.shape[1] // 32):
        raise V41LoadError(f"{tensors.where_is(name)} is FP8 and needs {scale} "
                           f"[{values.shape[0]}, {values.shape[1] // 32}]")
    return values, _as_float(tensors.view(scale))


def _expert_rows(tensors: Tensors, found: dict, layer: int, cfg: V41Config):
    """One layer's routed experts, one at a time: (expert, row) with row an MXFP4 dict
    {"gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"} when the checkpoint stores
    FP4, else {"gate_up": [2I, D] (gate rows, then up rows), "down": [D, I]} float32."""
    e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    shapes = {"w1": (i, d), "w3": (i, d), "w2": (d, i)}
    for expert in range(e):
        for w in shapes:
            if (expert, w) not in found:
                raise V41LoadError(f"{tensors.source}: "
                                   f"no tensor layers.{layer}.ffn.experts.{expert}.{w}.weight")
    for expert in range(e):
        parts = {w: _expert_weight(tensors, found[(expert, w)], shapes[w]) for w in shapes}
        if isinstance(parts["w1"], tuple):
            yield expert, {"gate_up_blocks": np.concatenate([parts["w1"][0], parts["w3"][0]]),
                           "gate_up_scales": np.concatenate([parts["w1"][1], parts["w3"][1]]),
                           "down_blocks": parts["w2"][0], "down_scales": parts["w2"][1]}
        else:
            yield expert, {"gate_up": np.concatenate([parts["w1"], parts["w3"]]), "down": parts["w2"]}


def _expert_weight(tensors: Tensors, name: str, shape: tuple[int, int]):
    """float32 [out, in], or FP4 as (blocks [out, in/32, 16] uint8, e8m0 scales [out, in/32] uint8)."""
    out, inn = shape
    if tensors.dtype(name) not in _PACKED:
        if tensors.shape(name) != shape:
            raise V41LoadError(f"{tensors.where_is(name)} has shape {tensors.shape(name)}, "
                               f"the config needs {shape}")
        return tensors.read_float(name)
    scale = tensors.scale_of(name)
    if tensors.shape(name) != (out, inn // 2):
        raise V41LoadError(f"{tensors.where_is(name)}: FP4 expert weight should be uint8 "
                           f"[{out}, {inn // 2}], got {list(tensors.shape(name))}")
    if scale is None or tensors.shape(scale) != (out, inn // 32):
        raise V41LoadError(f"{tensors.where_is(name)}: FP4 expert weight needs e8m0 scales "
                           f"[{out}, {inn // 32}] in {name.removesuffix('.weight')}.scale")
    blocks = np.array(tensors.view(name)).view(np.uint8).reshape(out, inn // 32, 16)
    raw = np.array(tensors.view(scale))
    return blocks, raw if raw.dtype == np.uint8 else raw.view(np.uint8)  # e8m0 bits = biased exponent


def engram_layout(cfg: V41Config, model_dir: Path, tokenizer=None) -> EngramLayout:
    """The hash layout, with the token map derived from the folder's tokenizer.json."""
    if tokenizer is None:
        from tokenizers import Tokenizer

        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise V41LoadError(f"{path}: Engram layers need the tokenizer to hash n-grams")
        tokenizer = Tokenizer.from_file(str(path))
    return EngramLayout.build(cfg.engram_layers, cfg.engram_max_ngram, cfg.engram_heads,
                              cfg.engram_vocab_size, compressed_token_map(tokenizer),
                              cfg.engram_pad_id, cfg.engram_compressed_vocab,
                              cfg.engram_num_embeddings, cfg.source)


def expert_dims(cfg: V41Config) -> tuple[int, int, int, int]:
    """Every layer is a MoE layer: (layers, experts, hidden, expert intermediate)."""
    return cfg.num_layers, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size


def load_weights(cfg: V41Config, model_dir, raw_config: dict, serve, dtype, put_row):
    """The family's loader: (dense params, the checkpoint as the host-side aux: Engram tables).
    The params have no declaration of logical axes yet: they are placed replicated."""
    checkpoint = load(model_dir, dtype=dtype, put_row=put_row)
    return parallel.replicated(checkpoint.params["params"]), checkpoint

