"""The tensors of a synthetic checkpoint, derived from its family's declaration: every declared
param (the family's weights.py: param_specs, host_specs) under the name its checkpoint table
fills it from, and the routed experts (expert_specs) under the table's expert names, stored as
the family's published checkpoints store them (LAYOUTS; by default BF16, but for float32-declared
vectors, which stay float32, and fused routed experts, MXFP4 or BF16 as asked).

A tensor is (name, dtype, shape, filler); a filler is a picklable (kind, parameter) that
tools.make_synthetic.fill turns into values: a param declared ones or zeros is that constant, a
weight has values of std about 1/sqrt(fan_in) (fan_in its last dimension; 1 for a table of rows:
an embedding, declared stddev 1, or a host table), FP8 / MXFP4 / FP4 codes are random with e8m0
scales sized so a projection keeps unit variance.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tidejax.checkpoint import fp8
from tidejax.checkpoint.table import Table
from tidejax.models.registry import FAMILY_MODULES, family_for

BF16 = np.dtype(ml_dtypes.bfloat16)
F32, U8, I8 = np.dtype(np.float32), np.dtype(np.uint8), np.dtype(np.int8)
E4M3, E8M0 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e8m0fnu)

E2M1_MEAN_SQUARE = 8.5625  # mean of v**2 over the 16 e2m1 codes


def e4m3_codes(bits: np.ndarray) -> np.ndarray:
    """Random bytes -> e4m3 codes: random sign and mantissa, exponent over the 4 octaves below 2."""
    return (bits & 0x87) | ((4 + ((bits >> 3) & 3)) << 3)


E4M3_MEAN_SQUARE = float(np.mean(np.square(
    e4m3_codes(np.arange(256, dtype=np.uint8)).view(ml_dtypes.float8_e4m3fn).astype(np.float32))))

# fillers
CODES = ("codes", 0)
E4M3_CODES = ("e4m3", 0)


def uniform(fan_in: int, dtype=BF16) -> tuple:
    return ("bf16" if dtype == BF16 else "f32", fan_in)


def const(value: float, dtype) -> tuple:
    return ("const_bf16" if dtype == BF16 else "const_f32", value)


def scales(fan_in: int, mean_square: float = E2M1_MEAN_SQUARE) -> tuple:
    return ("scales", fan_in * mean_square)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a family's published checkpoints store its tensors where it is not the default;
    `fp8`, `f32` and `prefer` are regexes over checkpoint names."""

    fp8: str = "$^"  # stored FP8: e4m3 + e8m0 `.scale` per block (the table's, else the config's)
    f32: str = "$^"  # kept float32, beside the float32-declared vectors
    prefer: str = "$^"  # the published name, where the table fills a param from several
    fp4_experts: bool = False  # routed experts per expert, e2m1 pairs + e8m0 `.scale` [out, in/32]
    extras: Callable = lambda cfg: []  # tensors also published, which the table ignores


def _ds41_extras(cfg) -> list[tuple]:
    """The image-token router bias of every layer and the image markers (text decoding leaves
    them unused)."""
    e, d = cfg.n_routed_experts, cfg.hidden_size
    return [(f"layers.{i}.ffn.gate.bias_vl", F32, (e,), const(0.0, F32))
            for i in range(cfg.num_layers)] + [
        (name, BF16, (d,), uniform(1)) for name in ("image_start", "image_end", "image_newline")]


LAYOUTS = {
    "deepseek_v41": Layout(
        fp8=r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
            r"|engram\.(wkv|embed))\.weight",
        f32=r"layers\.\d+\.hc_(attn|ffn)_fn", prefer=r"head\.weight", fp4_experts=True,
        extras=_ds41_extras),
}


@dataclasses.dataclass(frozen=True)
class Declared:
    """A config.json's family config, checkpoint table and declared trees (model dtype bf16)."""

    cfg: object
    table: Table
    params: dict
    experts: dict
    host: dict  # rows read from host memory in the step (V4.1's Engram tables)
    mtp: dict  # the MTP layers (config.json's num_nextn_predict_layers), per-expert BF16 experts

    @staticmethod
    def of(raw_cfg: dict) -> Declared:
        family = family_for(raw_cfg, "synthetic config.json")
        cfg = family.config_from_hf(raw_cfg, "synthetic config.json")
        weights = family_weights(raw_cfg)
        host = weights.host_specs(cfg) if hasattr(weights, "host_specs") else {}
        mtp = (family.mtp_specs(cfg, jnp.bfloat16)
               if getattr(cfg, "num_mtp_layers", 0) and family.mtp_specs is not None else {})
        return Declared(cfg, weights.checkpoint_table(cfg), weights.param_specs(cfg, jnp.bfloat16),
                        weights.expert_specs(cfg, jnp.bfloat16), host, mtp)

    def name(self, path: tuple, layout: Layout) -> str:
        """The one checkpoint name params `path` are written under."""
        names = self.table.param_names(path)
        if len(names) > 1:
            names = [n for n in names if re.fullmatch(layout.prefer, n)]
        if len(names) != 1:
            raise ValueError(f"synthetic: params {path}: the checkpoint table gives "
                             f"{self.table.param_names(path) or 'no name'}; Layout.prefer must "
                             f"pick one")
        if any(rule.transform for rule, _, _ in self.table.matches(names[0])):
            raise ValueError(f"synthetic: '{names[0]}' is transformed on load; write it as stored")
        return names[0]

    def routers(self) -> list[tuple[int, str, str | None]]:
        """(layer, router weight name, correction bias name or None) of each MoE layer."""
        out = []
        declared = {path for path, _ in flatten(self.params)}
        for path in declared:
            if path[-1] == "gate_weight":
                bias = (*path[:-1], "gate_bias")
                out.append((int(path[0].removeprefix("layers_")), self.name(path, Layout()),
                            self.name(bias, Layout()) if bias in declared else None))
        out.sort()
        return out


def family_weights(raw_cfg: dict):
    """The weights module (param_specs, expert_specs, checkpoint_table, ...) of the family of a
    config.json."""
    package = FAMILY_MODULES[raw_cfg["model_type"]].rsplit(".", 1)[0]
    return importlib.import_module(f"{package}.weights")


def flatten(tree: dict, prefix: tuple = ()) -> list[tuple[tuple, object]]:
    out = []
    for key, value in tree.items():
        out += flatten(value, (*prefix, key)) if isinstance(value, dict) else [((*prefix, key), value)]
    return out


def checkpoint_tensors(raw_cfg: dict, experts: str, router_bias: Callable | None = None
                       ) -> list[tuple[str, list[tuple]]]:
    """The shards [(file, tensors)] of a synthetic checkpoint of `raw_cfg` (config.json): the
    top-level tensors in model-top.safetensors, layer i's in model-layer{i:03d}.safetensors.
    experts: "mxfp4" | "bf16", the fused routed experts' format (a Layout with fp4_experts
    ignores it). router_bias(layer, n_experts): the filler of a layer's router correction bias
    (None: zeros)."""
    declared = Declared.of(raw_cfg)
    layout = LAYOUTS.get(raw_cfg["model_type"], Layout())
    block = fp8.config_block(raw_cfg)
    tensors = []
    for tree, rows in ((declared.params, False), (declared.host, True), (declared.mtp, False)):
        for path, spec in flatten(tree):
            name = declared.name(path, layout)
            fan_in = 1 if rows or spec.stddev == 1.0 else spec.shape[-1]
            if re.fullmatch(layout.fp8, name):
                tensors += _fp8(name, spec.shape, fan_in, _fp8_block(declared.table, name, block))
                continue
            dtype = F32 if re.fullmatch(layout.f32, name) or (
                np.dtype(spec.dtype) == F32 and len(spec.shape) == 1) else BF16
            if path[-1] == "gate_bias" and router_bias is not None:
                filler = router_bias(int(path[0].removeprefix("layers_")), spec.shape[0])
            elif spec.init == "normal":
                filler = uniform(fan_in, dtype)
            else:
                filler = const(1.0 if spec.init == "ones" else 0.0, dtype)
            tensors.append((name, dtype, spec.shape, filler))
    tensors += _routed(declared, layout, experts) + layout.extras(declared.cfg)
    return _shards(tensors)


def _fp8_block(table: Table, name: str, block: tuple[int, int]) -> tuple[int, int]:
    return next((b for rx, b in table.fp8_blocks.items() if re.fullmatch(rx, name)), block)


def _fp8(name: str, shape: tuple, fan_in: int, block: tuple[int, int]) -> list[tuple]:
    """A weight in e4m3 codes and its e8m0 scales, one a block (as the reader pairs them)."""
    blocks = tuple(-(-n // b) for n, b in zip(shape, block))
    return [(name, E4M3, shape, E4M3_CODES),
            (fp8.scale_names(name)[1], E8M0, blocks, scales(fan_in, E4M3_MEAN_SQUARE))]


def _routed(declared: Declared, layout: Layout, experts: str) -> list[tuple]:
    """The routed experts of every MoE layer under the table's expert names: per expert in FP4
    or (where the table names no fused tensors) BF16, or fused [E, ...] in MXFP4 (`_blocks`,
    `_scales`) or BF16."""
    table = declared.table
    rows, two_f, d = declared.experts["gate_up"].shape
    f = declared.experts["down"].shape[-1]
    e = rows // len(table.expert_layers)
    dims = {"gate": (f, d), "up": (f, d), "gate_up": (two_f, d), "down": (d, f)}
    out = []
    for layer in table.expert_layers:
        if layout.fp4_experts:
            for x in range(e):
                for part in ("gate", "up", "down"):
                    (name,), (rows_out, inn) = table.expert_names(layer, part, x), dims[part]
                    out += [(name, I8, (rows_out, inn // 2), CODES),
                            (fp8.scale_names(name)[1], E8M0, (rows_out, inn // 32), scales(inn))]
            continue
        if not table.expert_names(layer, "gate_up"):  # published per expert (Mixtral's names)
            if experts != "bf16":
                raise ValueError(f"synthetic: {layer}'s experts are published per expert in "
                                 "BF16; write them --experts bf16")
            out += [(name, BF16, dims[part], uniform(dims[part][1])) for x in range(e)
                    for part in ("gate", "up", "down")
                    for name in table.expert_names(layer, part, x)]
            continue
        for part in ("gate_up", "down"):
            (name,), (rows_out, inn) = table.expert_names(layer, part), dims[part]
            if experts != "mxfp4" and any(rule.transform for rule, _, _ in table.matches(name)):
                raise ValueError(f"synthetic: '{name}' is transformed on load in its float "
                                 "layout; write the experts MXFP4 (as published)")
            if experts == "mxfp4":
                out += [(f"{name}_blocks", U8, (e, rows_out, inn // 32, 16), CODES),
                        (f"{name}_scales", U8, (e, rows_out, inn // 32), scales(inn))]
            else:
                out.append((name, BF16, (e, rows_out, inn), uniform(inn)))
        for part, width in (("gate_up_bias", two_f), ("down_bias", d)):  # where declared
            if part in declared.experts:
                (name,) = table.expert_names(layer, part)
                out.append((name, BF16, (e, width), const(0.0, BF16)))
    return out


_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")


def _shards(tensors: list[tuple]) -> list[tuple[str, list[tuple]]]:
    """One shard per decoder layer (by the name's `layers.{i}.`), the rest in the top one."""
    shards: dict[str, list] = {"model-top.safetensors": []}
    layered = {}
    for t in tensors:
        m = _LAYER.match(t[0])
        if m is None:
            shards["model-top.safetensors"].append(t)
        else:
            layered.setdefault(int(m[1]), []).append(t)
    return list(shards.items()) + [(f"model-layer{i:03d}.safetensors", layered[i])
                                   for i in sorted(layered)]
