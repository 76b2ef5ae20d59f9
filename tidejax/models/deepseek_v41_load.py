"""Loading a DeepSeek-V4.1 checkpoint folder: config, dense params (flax tree), routed-expert
banks (dense {"gate_up", "down"} per layer), Engram tables (host numpy) and the Engram hash
layout (from the tokenizer).

Tensor names are the reference's module paths (`model.layers.{i}.attn.wq_a.weight`, ...); the
published checkpoint's names without the `model.` prefix are accepted too. Loading fails on any
unmapped tensor, unfilled parameter or shape mismatch, naming it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from tidejax.models.deepseek_v41 import DeepseekV41, V41Cache
from tidejax.models.deepseek_v41_config import V41Config
from tidejax.models.engram import EngramLayout, compressed_token_map

# Tensors present in checkpoints that the text forward does not use: image-token router bias,
# DSpark draft layers, the vision tower (no reference forward exists for these yet).
IGNORED = (r"\.ffn\.gate\.bias_vl$", r"(^|\.)mtp\.", r"^vision\.", r"^aligner\.",
           r"^image_(start|end|newline)$")
_RENAMES = {("embed", "weight"): ("embed",), ("lm_head", "weight"): ("lm_head",),
            ("attn", "wo_a", "weight"): ("attn", "wo_a"),
            ("ffn", "gate", "weight"): ("ffn", "gate_weight"),
            ("ffn", "gate", "bias"): ("ffn", "gate_bias")}
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_ENGRAM = re.compile(r"^layers\.(\d+)\.engram\.embed\.(weight|scale)$")


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
    model = DeepseekV41(cfg, kernel="reference")
    b, t = 1, 1
    cache = V41Cache.create(cfg, b, 4)
    rows = jnp.zeros((b, t, len(cfg.engram_layers), cfg.engram_cols, cfg.engram_head_dim))
    experts = [empty_bank(cfg)] * cfg.num_layers
    tok = jnp.zeros((b, t), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tok, tok, tok > -1, cache,
                                               rows if cfg.engram_layers else None, experts))
    return shapes["params"]


def empty_bank(cfg: V41Config) -> dict:
    e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    return {"gate_up": jnp.zeros((e, 2 * i, d), jnp.float32), "down": jnp.zeros((e, d, i), jnp.float32)}


@dataclasses.dataclass
class V41Checkpoint:
    cfg: V41Config
    params: dict  # {"params": flax tree}
    experts: list  # per layer {"gate_up": [E, 2I, D], "down": [E, D, I]}
    engram_tables: list  # per Engram layer: [rows, e] float32 (host)
    engram_layout: EngramLayout | None


def load_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """All tensors of the folder's safetensors files (float32 checkpoints), names without the
    `model.` prefix."""
    from safetensors.numpy import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise V41LoadError(f"{model_dir}: no *.safetensors file")
    out: dict[str, np.ndarray] = {}
    for f in files:
        for name, value in load_file(f).items():
            key = name[len("model."):] if name.startswith("model.") else name
            if key in out:
                raise V41LoadError(f"{f}: tensor {name} appears twice in the checkpoint")
            out[key] = value
    return out


def load(model_dir, tokenizer=None) -> V41Checkpoint:
    """Reads config.json, *.safetensors and tokenizer.json of a V4.1 folder."""
    model_dir = Path(model_dir)
    cfg = V41Config.from_file(model_dir)
    tensors = load_tensors(model_dir)
    shapes = flatten_dict(param_shapes(cfg))
    params: dict = {}
    e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
    experts = {}
    tables: dict[int, np.ndarray] = {}
    for name, value in tensors.items():
        if any(re.search(p, name) for p in IGNORED):
            continue
        if m := _EXPERT.match(name):
            experts.setdefault(int(m[1]), {})[(int(m[2]), m[3])] = value
            continue
        if m := _ENGRAM.match(name):
            if m[2] == "weight":
                tables[int(m[1])] = np.asarray(value, np.float32)
            continue
        path = param_path(name)
        if path not in shapes:
            raise V41LoadError(f"{model_dir}: tensor {name} has no place in the model")
        if tuple(value.shape) != shapes[path].shape:
            raise V41LoadError(f"{model_dir}: tensor {name} has shape {tuple(value.shape)}, "
                               f"the config needs {shapes[path].shape}")
        params[path] = jnp.asarray(value, jnp.float32)
    missing = [p for p in shapes if p not in params]
    if missing:
        raise V41LoadError(f"{model_dir}: no tensor for parameter {'/'.join(missing[0])} "
                           f"({len(missing)} missing)")
    banks = [_bank(model_dir, experts.get(layer, {}), layer, e, i, cfg.hidden_size)
             for layer in range(cfg.num_layers)]
    for layer in cfg.engram_layers:
        if layer not in tables:
            raise V41LoadError(f"{model_dir}: no tensor layers.{layer}.engram.embed.weight")
    layout = None
    if cfg.engram_layers:
        layout = engram_layout(cfg, model_dir, tokenizer)
    return V41Checkpoint(cfg, {"params": unflatten_dict(params)}, banks,
                         [tables[layer] for layer in cfg.engram_layers], layout)


def _bank(model_dir, found: dict, layer: int, e: int, i: int, d: int) -> dict:
    """Stacks one layer's experts into the dense bank layout (gate rows, then up rows)."""
    for expert in range(e):
        for w, shape in (("w1", (i, d)), ("w3", (i, d)), ("w2", (d, i))):
            value = found.get((expert, w))
            if value is None:
                raise V41LoadError(f"{model_dir}: no tensor layers.{layer}.ffn.experts.{expert}.{w}.weight")
            if tuple(value.shape) != shape:
                raise V41LoadError(f"{model_dir}: tensor layers.{layer}.ffn.experts.{expert}.{w}.weight "
                                   f"has shape {tuple(value.shape)}, the config needs {shape}")
    gate_up = np.stack([np.concatenate([found[(x, "w1")], found[(x, "w3")]]) for x in range(e)])
    down = np.stack([found[(x, "w2")] for x in range(e)])
    return {"gate_up": jnp.asarray(gate_up, jnp.float32), "down": jnp.asarray(down, jnp.float32)}


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
