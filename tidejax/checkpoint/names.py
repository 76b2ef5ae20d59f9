"""Declarative loading: a model family gives a name table, this module reads, maps and checks.

Each loader first checks its rules against the headers (missing tensor, shape, duplicate
mapping) and claims the tensors in the reader, then reads one tensor at a time;
`reader.check_all_consumed(ignore)` then finds anything no rule claimed. `load_checkpoint`
runs every check, unmapped tensors included, before reading any data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from tidejax.checkpoint.reader import CheckpointReader
from tidejax.checkpoint.safetensors_io import CheckpointError

ParamPath = tuple  # a params path: keys of nested dicts, e.g. ("layers", 3, "attn", "q_a_proj")


@dataclasses.dataclass(frozen=True)
class Rule:
    """Target <- checkpoint tensor `source`, whose stored shape must be `shape` (HF layout,
    after FP8 dequantization), then `transform` (e.g. np.transpose) and the dtype cast."""
    source: str
    shape: tuple[int, ...]
    transform: Callable[[np.ndarray], np.ndarray] | None = None


def _as_rule(rule: Rule | tuple) -> Rule:
    return rule if isinstance(rule, Rule) else Rule(rule[0], tuple(rule[1]), *rule[2:])


def check_shape(reader: CheckpointReader, name: str, shape: Sequence[int], target: str) -> None:
    if name not in reader:
        raise reader.missing(name, target)
    if reader.shape(name) != tuple(shape):
        raise CheckpointError(f"{reader.file_of(name)}: tensor '{name}' has shape "
                              f"{list(reader.shape(name))}, {target} expects {list(shape)}")


def _cast(a: np.ndarray, dtype) -> np.ndarray:
    return a if dtype is None else a.astype(dtype, copy=False)


def load_params(reader: CheckpointReader,
                table: Mapping[ParamPath, Rule | tuple] | Iterable[tuple[ParamPath, Rule | tuple]],
                *, dtype=None, put: Callable[[ParamPath, np.ndarray], Any] | None = None) -> dict:
    """Load every rule of `table` (target path -> Rule or (source, shape[, transform])) into
    a nested dict {path[0]: {path[1]: ... put(path, array)}}. `dtype`: numpy/jnp dtype to
    cast to (None: as stored; FP8 pairs come as float32). `put` turns the host array into
    the stored leaf (e.g. a jax.device_put with a sharding); default: the numpy array."""
    return _read_params(reader, _plan_params(reader, table), dtype, put)


def load_routed_experts(reader: CheckpointReader, layer_prefixes: Sequence[str],
                        n_experts: int, hidden: int, inter: int,
                        put_row: Callable[[int, dict[str, np.ndarray]], None],
                        *, dtype=None) -> None:
    """Emit each routed expert as put_row(m * n_experts + e, {"gate_up": [2I, D] (gate rows,
    then up rows), "down": [D, I]}) for the m-th prefix of `layer_prefixes` (e.g.
    "model.layers.3.mlp"). Each layer may use either layout:
      per-expert: {prefix}.experts.{e}.{gate_proj,up_proj}.weight [I, D], .down_proj.weight
                  [D, I] (FP8 pairs allowed);
      fused (transformers 5): {prefix}.experts.gate_up_proj [E, 2I, D],
                  {prefix}.experts.down_proj [E, D, I];
      MXFP4: {prefix}.experts.{gate_up,down}_proj_{blocks,scales} (emitted as MXFP4 rows)."""
    plan = _plan_experts(reader, layer_prefixes, n_experts, hidden, inter)
    _read_experts(reader, plan, n_experts, put_row, dtype)


def load_checkpoint(reader: CheckpointReader, table, *, ignore: Iterable[str] = (),
                    experts: tuple[Sequence[str], int, int, int] | None = None,
                    put_row: Callable[[int, dict[str, np.ndarray]], None] | None = None,
                    dtype=None, put: Callable[[ParamPath, np.ndarray], Any] | None = None) -> dict:
    """load_params + load_routed_experts + reader.check_all_consumed in one call, with every
    check (missing, shape, duplicate, unmapped) done on the headers before any data is read.
    `experts`: (layer_prefixes, n_experts, hidden, inter), rows emitted through `put_row`."""
    params_plan = _plan_params(reader, table)
    experts_plan = _plan_experts(reader, *experts) if experts is not None else []
    reader.check_all_consumed(ignore)
    params = _read_params(reader, params_plan, dtype, put)
    if experts is not None:
        _read_experts(reader, experts_plan, experts[1], put_row, dtype)
    return params


def _plan_params(reader: CheckpointReader, table) -> list[tuple[ParamPath, Rule]]:
    """Check and claim every rule's source from the headers."""
    items = list(table.items() if isinstance(table, Mapping) else table)
    rules, seen = [], set()
    for path, rule in items:
        path, rule = tuple(path), _as_rule(rule)
        if path in seen:
            raise CheckpointError(f"{reader.source}: params path {path} has two rules")
        seen.add(path)
        check_shape(reader, rule.source, rule.shape, f"params {path}")
        reader.claim(rule.source, by=f"params {path}")
        rules.append((path, rule))
    return rules


def _read_params(reader: CheckpointReader, rules, dtype, put) -> dict:
    out: dict = {}
    for path, rule in rules:
        a = reader.read(rule.source)
        if rule.transform is not None:
            a = rule.transform(a)
        a = _cast(a, dtype)
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = put(path, a) if put is not None else a
    return out


# bank leaf -> the fused MXFP4 tensor under "{prefix}.experts." (gate rows first, then up rows)
MXFP4_TENSORS = {"gate_up_blocks": "gate_up_proj_blocks", "gate_up_scales": "gate_up_proj_scales",
                 "down_blocks": "down_proj_blocks", "down_scales": "down_proj_scales"}


def _plan_experts(reader: CheckpointReader, layer_prefixes: Sequence[str], n_experts: int,
                  hidden: int, inter: int) -> list[tuple[int, str, str]]:
    """Check and claim every layer's expert tensors from the headers: [(m, prefix, layout)] with
    layout "per_expert", "fused" (transformers 5) or "mxfp4" (fused blocks and scales)."""
    E, D, I = n_experts, hidden, inter
    plan = []
    for m, prefix in enumerate(layer_prefixes):
        fused = (f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj")
        packed = {part: f"{prefix}.experts.{name}" for part, name in MXFP4_TENSORS.items()}
        if packed["gate_up_blocks"] in reader:
            shapes = {"gate_up_blocks": (E, 2 * I, D // 32, 16), "gate_up_scales": (E, 2 * I, D // 32),
                      "down_blocks": (E, D, I // 32, 16), "down_scales": (E, D, I // 32)}
            for part, name in packed.items():
                check_shape(reader, name, shapes[part], f"MXFP4 routed experts of '{prefix}'")
                reader.claim(name)
            plan.append((m, prefix, "mxfp4"))
            continue
        if any(n in reader for n in fused):
            if f"{prefix}.experts.0.gate_proj.weight" in reader:
                where = reader.file_of(fused[0] if fused[0] in reader else fused[1])
                raise CheckpointError(f"{where}: layer '{prefix}' holds experts in both the "
                                      f"fused and the per-expert layout")
            for name, shape in zip(fused, ((E, 2 * I, D), (E, D, I))):
                check_shape(reader, name, shape, f"routed experts of '{prefix}'")
                reader.claim(name)
            plan.append((m, prefix, "fused"))
            continue
        for e in range(E):
            for proj, shape in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
                name = f"{prefix}.experts.{e}.{proj}.weight"
                check_shape(reader, name, shape, f"expert {e} of '{prefix}'")
                reader.claim(name)
        plan.append((m, prefix, "per_expert"))
    return plan


def _read_experts(reader: CheckpointReader, plan, E: int, put_row, dtype) -> None:
    """Rows go out as stored: dense {"gate_up", "down"} (cast to dtype) or MXFP4 blocks/scales."""
    for m, prefix, layout in plan:
        if layout == "mxfp4":
            names = [f"{prefix}.experts.{name}" for name in MXFP4_TENSORS.values()]
            for e, parts in enumerate(zip(*(reader.read_rows(n) for n in names))):
                put_row(m * E + e, dict(zip(MXFP4_TENSORS, parts)))
            continue
        if layout == "fused":
            rows = zip(reader.read_rows(f"{prefix}.experts.gate_up_proj"),
                       reader.read_rows(f"{prefix}.experts.down_proj"))
            for e, (gate_up, down) in enumerate(rows):
                put_row(m * E + e, {"gate_up": _cast(gate_up, dtype), "down": _cast(down, dtype)})
            continue
        for e in range(E):
            p = f"{prefix}.experts.{e}"
            gate_up = np.concatenate([_cast(reader.read(f"{p}.gate_proj.weight"), dtype),
                                      _cast(reader.read(f"{p}.up_proj.weight"), dtype)])
            put_row(m * E + e, {"gate_up": gate_up,
                                "down": _cast(reader.read(f"{p}.down_proj.weight"), dtype)})
