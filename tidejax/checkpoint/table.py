"""The checkpoint table: one declarative map from checkpoint tensor names to a family's declared
params and routed-expert rows, checked whole against the headers before any tensor data is read.

A pattern is literal text with fields, `{name}` (digits) or `{name:REGEX}`, and matches whole
names; a rule's target uses the fields of its source (a source field the target does not use,
e.g. an optional prefix `{p:(?:model\\.)?}`, is empty in the names an error message expects)::

    table = Table(rules=(
        Rule("model.embed_tokens.weight", "embed"),
        Rule("model.layers.{i}.mlp.{proj:gate|up|down}_proj.weight",
             "layers_{i}.mlp.{proj}_proj.weight"),
        # routed experts: field `layer` is one of expert_layers (rowmap order), `expert` the
        # expert (absent: all experts stacked on a leading axis), `part` gate | up | gate_up | down
        Experts(r"{layer:model\\.layers\\.\\d+\\.mlp}.experts.{expert}.{part:gate|up|down}_proj.weight"),
        Experts(r"{layer:model\\.layers\\.\\d+\\.mlp}.experts.{part:gate_up|down}_proj"),
    ), ignore=("{any:.*}rotary_emb.inv_freq",), expert_layers=("model.layers.1.mlp", ...))

    params = load(reader, table, abstract(param_specs), abstract(expert_specs),
                  put=lambda path, a: jnp.asarray(a), put_row=pool.put_row)

`host`: a third declared tree (paths apart from the params') of tensors kept on the host as
stored, memory-mapped (reader.keep: an array, or fp8 (values, float32 scales)), returned in the
same tree as the params: DeepSeek-V4.1's Engram tables. `Table.fp8_blocks` gives the FP8 scale
block of the tensors whose names match a pattern, where it is not the checkpoint's own.

Checks, all on the headers, all problems reported in one CheckpointError naming file and tensor:
unmapped (no rule and no ignore pattern matches a tensor), multi-match (two rules match one),
no place (a rule's target is not declared), duplicate (two tensors fill one param or expert
part), shape (the logical shape, after the rule's transform, against the declaration), unfilled
(a declared param or expert part that no tensor fills, named by the tensor the table expects),
and the routed experts' layouts (both layouts for one expert, MXFP4 mixed with dense in a layer,
a layer that is not a MoE layer, an expert past the count). Ignore patterns win over the rules
(e.g. the multi-token-prediction layers after the last decoder layer). Then each param is read,
cast to its declared dtype and put, and the experts emitted row by row as
put_row(moe_layer * E + expert, {"gate_up": [2I, D] (gate rows, then up), "down": [D, I]}) as
stored (FP8 as float32) or, for MXFP4 experts, {"gate_up_blocks", "gate_up_scales", "down_blocks",
"down_scales"}. Tensors are read in READ_WORKERS threads: put and put_row are called from them,
in no particular order.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from tidejax.checkpoint import fp8, mxfp4
from tidejax.checkpoint.reader import CheckpointReader, Tensor
from tidejax.errors import CheckpointError

_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
ParamPath = tuple  # keys of nested dicts, e.g. ("layers_3", "attn", "q_a_proj", "weight")
EXPERT_PARTS = ("gate", "up", "gate_up", "down", "gate_up_bias", "down_bias")
_FIELD = re.compile(r"\{(\w+)(?::([^{}]*))?\}")
_SHOWN = 20  # problems listed in one error
READ_WORKERS = min(16, os.cpu_count() or 1)  # threads reading tensors (see _in_threads)


class Pattern:
    """Literal text with fields `{name}` (digits, or the REGEX `fields` gives the name) or
    `{name:REGEX}`; matches whole names."""

    def __init__(self, text: str, fields: Mapping[str, str] | None = None):
        self.text, self.fields = text, {}
        pieces, last = [], 0
        for m in _FIELD.finditer(text):
            self.fields[m[1]] = m[2] or (fields or {}).get(m[1], "[0-9]+")
            pieces += [re.escape(text[last:m.start()]), f"(?P<{m[1]}>{self.fields[m[1]]})"]
            last = m.end()
        self.regex = re.compile("".join(pieces) + re.escape(text[last:]))

    def match(self, name: str) -> dict[str, str] | None:
        m = self.regex.fullmatch(name)
        return None if m is None else m.groupdict()

    def format(self, fields: Mapping[str, str]) -> str:
        """The text with the fields filled in (a field not given stays as written)."""
        return _FIELD.sub(lambda m: str(fields.get(m[1], m[0])), self.text)


@dataclasses.dataclass(frozen=True)
class Transform:
    """A change of layout from the stored tensor to the param: its effect on the shape (for the
    header checks) and on the array."""
    name: str
    shape: Callable[[tuple[int, ...]], tuple[int, ...]]
    apply: Callable[[np.ndarray], np.ndarray]


TRANSPOSE = Transform("transposed", lambda shape: shape[::-1], np.transpose)


@dataclasses.dataclass(frozen=True)
class Rule:
    """Params `target` (dotted path, with the source's fields) <- checkpoint tensors `source`."""
    source: str
    target: str
    transform: Transform | None = None


@dataclasses.dataclass(frozen=True)
class Experts:
    """Routed-expert rows <- checkpoint tensors `source` (fields `layer`, optionally `expert`);
    `part`: one of EXPERT_PARTS, or a pattern of them over the source's fields."""
    source: str
    part: str = "{part}"
    transform: Transform | None = None  # applied to each expert's slice (after the read)
    packed: Transform | None = None  # in its place where the tensor is MXFP4 (blocks and scales
    # alike, on the logical shape): a published layout that differs from the float one


class Table:
    """A family's checkpoint table: rules, ignore patterns, and the `layer` field values of the
    MoE layers in rowmap order."""

    def __init__(self, rules: Sequence[Rule | Experts], ignore: Sequence[str] = (),
                 expert_layers: Sequence[str] = (),
                 fp8_blocks: Mapping[str, tuple[int, int]] | None = None):
        self.rules, self.expert_layers = tuple(rules), tuple(expert_layers)
        self.ignore = tuple(Pattern(p) for p in ignore)
        # pattern -> (rows, cols) FP8 scale block, as CheckpointReader(fp8_blocks=) takes it
        self.fp8_blocks = {Pattern(p).regex.pattern: tuple(b) for p, b in (fp8_blocks or {}).items()}
        self._compiled = []
        for rule in self.rules:
            source = Pattern(rule.source)
            target = Pattern(rule.target if isinstance(rule, Rule) else rule.part, source.fields)
            needed = set(target.fields) | ({"layer"} if isinstance(rule, Experts) else set())
            if not needed <= set(source.fields):
                raise ValueError(f"checkpoint table: rule {rule} uses fields "
                                 f"{sorted(needed - set(source.fields))} its source lacks")
            self._compiled.append((rule, source, target))

    def ignores(self, name: str) -> bool:
        return any(p.match(name) is not None for p in self.ignore)

    def matches(self, name: str) -> list[tuple[Rule | Experts, Pattern, dict[str, str]]]:
        """Every rule whose source matches `name`: (rule, its target pattern, the fields)."""
        return [(rule, target, fields) for rule, source, target in self._compiled
                if (fields := source.match(name)) is not None]

    def param_names(self, path: ParamPath) -> list[str]:
        """The checkpoint names the rules fill params `path` from (as many as rules give it)."""
        return self._names(lambda rule, source: isinstance(rule, Rule), ".".join(path), {})

    def expert_names(self, layer: str, part: str, expert: int | None = None) -> list[str]:
        """The checkpoint names the rules fill `part` of routed expert `expert` of `layer` from
        (expert None: the stacked tensors of every expert)."""
        def per_expert(rule, source) -> bool:
            return isinstance(rule, Experts) and ("expert" in source.fields) == (expert is not None)
        return self._names(per_expert, part, {"layer": layer, "expert": str(expert)})

    def _names(self, which, target_text: str, fields: dict[str, str]) -> list[str]:
        names = []
        for rule, source, target in self._compiled:
            found = target.match(target_text) if which(rule, source) else None
            if found is not None:
                name = source.format({**dict.fromkeys(source.fields, ""), **fields, **found})
                if source.match(name) is not None:  # the fields fit the source's patterns
                    names.append(name)
        return names


def load(reader: CheckpointReader, table: Table, params: Mapping, experts: Mapping | None = None,
         *, put: Callable[[ParamPath, np.ndarray], Any] | None = None,
         put_row: Callable[[int, dict], None] | None = None, host: Mapping | None = None) -> dict:
    """Check the whole checkpoint against `table` and the declaration on the headers, then read.

    params: nested dicts whose leaves have .shape and .dtype (models.base.abstract(specs));
    experts: {"gate_up": [rows, 2I, D], "down": [rows, D, I]} likewise, rows = len(expert_layers)
    * experts a layer, emitted through `put_row`; host: leaves kept as stored (reader.keep).
    Returns the params as nested dicts of put(path, array) (default: the numpy array) in each
    param's declared dtype, with the host leaves beside them. A weight declared float8_e4m3fn is
    put as stored (memory-mapped) with its float32 scales at the sibling "scale", on
    fp8.dividing_block (its block is then shape / scale shape)."""
    plan = _Plan(reader, table, params, experts, host or {})
    out = plan.read_params(put)
    if isinstance(put_row, Deferred):
        put_row.source = RowSource(plan)
        reader.later({t.name: t for r in range(put_row.source.n_rows)
                      for t in put_row.source.tensors(r)}.values())
        reader.progress.close()
    elif experts is not None:
        plan.read_experts(put_row)
    return out


class Deferred:
    """A put_row for `load` that reads no expert row: after the header checks it is handed the
    checked `RowSource` (`.source`), and rows are read later, one at a time, as they are needed
    (the residency disk tier: tidejax.residency.disk)."""

    source: "RowSource | None" = None


class RowSource:
    """The routed-expert rows of a checked checkpoint, read one at a time from the tensors'
    safetensors offsets: `read(row)` is what `load` hands put_row for that row."""

    def __init__(self, plan: "_Plan"):
        self._plan = plan
        self.n_rows = len(plan.table.expert_layers) * plan.n_experts

    def read(self, row: int) -> dict:
        """Row `row` (moe_layer * E + expert) as stored: {"gate_up", "down"} (FP8 as float32)
        or MXFP4 blocks and scales (_expert_row)."""
        return _expert_row(self._plan.row_parts(row))

    def read_direct(self) -> bool:
        """Rows read past the page cache from here (CheckpointReader.read_direct); whether
        every file takes O_DIRECT."""
        return self._plan.reader.read_direct()

    def read_all(self, put_row) -> None:
        """Every row read (in threads) and handed to put_row(row, arrays), as `load` does."""
        self._plan.read_experts(put_row)

    def tensors(self, row: int) -> list[Tensor]:
        return [tensor for tensor, _, _ in
                self._plan.rows[divmod(row, self._plan.n_experts)].values()]

    def files(self, row: int | None = None) -> list:
        """The files holding row `row`'s tensors (None: every expert row's), sorted."""
        rows = range(self.n_rows) if row is None else (row,)
        return sorted({self._plan.reader.file_of(t.name) for r in rows for t in self.tensors(r)})

    def stored_as_read(self) -> bool:
        """Whether a row reads as its files' bytes: no FP8 tensor (those are dequantized) and
        no transform (a change of layout)."""
        return all(t.format != "fp8" and transform is None for r in range(self.n_rows)
                   for t, _, transform in self._plan.rows[divmod(r, self._plan.n_experts)].values())

    def empty_row(self) -> dict:
        """A row of zeros shaped and typed as `read` gives one, without reading any data."""
        reader, parts = self._plan.reader, {}
        for part, (tensor, fused, transform) in self._plan.rows[(0, 0)].items():
            shape = tensor.shape[1:] if fused else tensor.shape
            if tensor.format == "mxfp4":
                groups = (*shape[:-1], shape[-1] // mxfp4.BLOCK)
                parts[part] = (np.zeros((*groups, mxfp4.BLOCK // 2), np.uint8),
                               np.zeros(groups, np.uint8))
            else:
                dtype = np.float32 if tensor.format == "fp8" else reader.dtype(tensor.parts[0])
                parts[part] = np.zeros(shape, dtype)
            parts[part] = _transformed(parts[part], transform)
        return _expert_row(parts)


def _transformed(read, transform: Transform | None):
    """An expert's part as read, through its rule's transform (MXFP4: on the blocks and the
    scales alike)."""
    if transform is None:
        return read
    return tuple(map(transform.apply, read)) if isinstance(read, tuple) else transform.apply(read)


def _flatten(tree: Mapping, prefix: ParamPath = ()) -> Iterator[tuple[ParamPath, Any]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _quoted(names: Sequence[str], joiner: str = " or ") -> str:
    return joiner.join(f"'{n}'" for n in names)


class _Plan:
    """Every check of `load`, on the headers: what each tensor fills."""

    def __init__(self, reader: CheckpointReader, table: Table, params: Mapping,
                 experts: Mapping | None, host: Mapping):
        self.reader, self.table = reader, table
        self.host = dict(_flatten(host))
        self.specs = dict(_flatten(params))
        if set(self.specs) & set(self.host):
            raise ValueError(f"checkpoint table: params and host leaves share paths "
                             f"{sorted(set(self.specs) & set(self.host))[:3]}")
        # an FP8 weight declared as stored (float8_e4m3fn) -> its scales' path, filled with it
        self.scale_of = {path: (*path[:-1], "scale") for path, spec in self.specs.items()
                         if np.dtype(spec.dtype) == _E4M3}
        self.specs.update(self.host)
        self.params: dict[ParamPath, tuple[Tensor, Rule]] = {}
        self.rows: dict[tuple[int, int], dict[str, tuple[Tensor, bool]]] = {}  # (m, e) -> parts
        self.problems: list[str] = []
        self.tried: set = set()  # params paths and (moe layer, part) a rejected tensor aimed at
        self.n_experts, self.part_shapes = self._expert_shapes(experts)
        unmapped, ignored, duplicates = [], [], {}
        for name, tensor in reader.tensors.items():
            if table.ignores(name):
                ignored.append(tensor)
                continue
            hits = table.matches(name)
            if len(hits) > 1:
                self.tried.update(tuple(target.format(fields).split("."))
                                  for rule, target, fields in hits if isinstance(rule, Rule))
                self._problem(name, f"tensor '{name}' is mapped twice, by "
                                    f"{_quoted([rule.source for rule, _, _ in hits], ' and ')}")
            elif not hits:
                unmapped.append(name)
            elif isinstance(hits[0][0], Rule):
                self._param(tensor, *hits[0])
            else:
                self._expert(tensor, *hits[0], duplicates)
        for (first, second, layer, part) in duplicates:
            self._problem(second, f"tensors '{first}' and '{second}' both fill the '{part}' of "
                                  f"routed experts of layer '{layer}'")
        self._check_unfilled()
        self._check_rows()
        if unmapped:
            shown = "; ".join(f"'{n}' in {reader.file_of(n)}" for n in unmapped[:10])
            more = f" (and {len(unmapped) - 10} more)" if len(unmapped) > 10 else ""
            self.problems.append(f"{reader.source}: {len(unmapped)} unexpected tensor(s) that "
                                 f"no rule maps: {shown}{more}")
        if self.problems:
            p = self.problems
            more = f"\n  (and {len(p) - _SHOWN} more)" if len(p) > _SHOWN else ""
            raise CheckpointError(p[0] if len(p) == 1 else f"{reader.source}: {len(p)} problems:"
                                  f"\n  " + "\n  ".join(p[:_SHOWN]) + more)
        for tensor in ignored:
            reader.done(tensor)

    def _problem(self, name: str, text: str) -> None:
        self.problems.append(f"{self.reader.file_of(name)}: {text}")

    def _expert_shapes(self, experts: Mapping | None) -> tuple[int, dict[str, tuple]]:
        if experts is None:
            return 0, {}
        rows, n_layers = experts["gate_up"].shape[0], len(self.table.expert_layers)
        if not n_layers or rows % n_layers:
            raise ValueError(f"checkpoint table: {rows} expert rows for {n_layers} MoE layers")
        gate_up, down = tuple(experts["gate_up"].shape[1:]), tuple(experts["down"].shape[1:])
        half = (gate_up[0] // 2, *gate_up[1:])
        biases = {k: tuple(experts[k].shape[1:]) for k in ("gate_up_bias", "down_bias")
                  if k in experts}  # declared biases are required parts
        return rows // n_layers, {"gate": half, "up": half, "gate_up": gate_up, "down": down,
                                  **biases}

    def _param(self, tensor: Tensor, rule: Rule, target, fields) -> None:
        name, path = tensor.name, tuple(target.format(fields).split("."))
        spec = self.specs.get(path)
        if spec is None:
            self._problem(name, f"tensor '{name}' has no place in the model (rule "
                                f"'{rule.source}' gives params {path}, which is not declared)")
            return
        if path in self.params:
            self._problem(name, f"tensors '{self.params[path][0].name}' and '{name}' both fill "
                                f"params {path}")
            return
        if rule.transform is not None and (path in self.host or path in self.scale_of):
            raise ValueError(f"checkpoint table: rule {rule} transforms a leaf kept as stored")
        shape = rule.transform.shape(tensor.shape) if rule.transform else tensor.shape
        if tuple(shape) != tuple(spec.shape):
            self.tried.add(path)
            how = f" ({rule.transform.name}: {list(shape)})" if rule.transform else ""
            self._problem(name, f"tensor '{name}' has shape {list(tensor.shape)}{how}, params "
                                f"{path} expects {list(spec.shape)}")
            return
        if path in self.scale_of and not self._fp8_fits(tensor, path):
            return
        self.params[path] = (tensor, rule)

    def _fp8_fits(self, tensor: Tensor, path: ParamPath) -> bool:
        """An FP8-declared weight needs an FP8 tensor whose scales, on the dividing block, have
        the declared scales' shape."""
        name, scale_path = tensor.name, self.scale_of[path]
        self.tried.update((path, scale_path))
        if tensor.format != "fp8":
            self._problem(name, f"tensor '{name}' is stored {tensor.format}, but params {path} "
                                f"are declared FP8 as stored (model.dense_format = 'fp8')")
            return False
        block = fp8.dividing_block(tensor.shape, self.reader.block_of(name))
        want = tuple(d // b for d, b in zip(tensor.shape, block))
        if want != tuple(self.specs[scale_path].shape):
            self._problem(name, f"tensor '{name}' has FP8 scales {list(want)} on block "
                                f"{list(block)}, params {scale_path} expect "
                                f"{list(self.specs[scale_path].shape)}")
            return False
        return True

    def _expert(self, tensor: Tensor, rule: Experts, part_pattern, fields, duplicates) -> None:
        name, layer, part = tensor.name, fields["layer"], part_pattern.format(fields)
        if not self.n_experts or layer not in self.table.expert_layers:
            self._problem(name, f"tensor '{name}' holds routed experts of '{layer}', which is not "
                                f"a MoE layer of this model")
            return
        if part not in EXPERT_PARTS:
            raise ValueError(f"checkpoint table: rule {rule} gives part {part!r}, not one of "
                             f"{EXPERT_PARTS}")
        m, fused = self.table.expert_layers.index(layer), "expert" not in fields
        if part not in self.part_shapes:
            self._problem(name, f"tensor '{name}' is the routed experts' '{part}' of layer "
                                f"'{layer}', which this model does not declare")
            return
        want = (self.n_experts, *self.part_shapes[part]) if fused else self.part_shapes[part]
        shape = tuple(tensor.shape)
        transform = rule.packed if tensor.format == "mxfp4" else rule.transform
        if transform is not None:  # on each expert's slice
            shape = ((shape[0], *transform.shape(shape[1:])) if fused
                     else tuple(transform.shape(shape)))
        if shape != want:
            self.tried.add((m, part))
            how = f" ({transform.name}: {list(shape)})" if transform else ""
            self._problem(name, f"tensor '{name}' has shape {list(tensor.shape)}{how}, the "
                                f"routed experts' '{part}' of layer '{layer}' expects {list(want)}")
            return
        experts = range(self.n_experts) if fused else [int(fields["expert"])]
        if experts[-1] >= self.n_experts:
            self._problem(name, f"tensor '{name}' is routed expert {experts[-1]} of layer "
                                f"'{layer}', which has {self.n_experts} experts")
            return
        for e in experts:
            row = self.rows.setdefault((m, e), {})
            if part in row:
                duplicates[(row[part][0].name, name, layer, part)] = None
            else:
                row[part] = (tensor, fused, transform)

    def _check_unfilled(self) -> None:
        filled_scales = {self.scale_of[p] for p in self.params if p in self.scale_of}
        for path in self.specs:
            if path not in self.params and path not in self.tried and path not in filled_scales:
                names = self.table.param_names(path)
                what = (f"missing tensor {_quoted(names)} (needed for params {path})" if names
                        else f"no rule of the table fills params {path}")
                self.problems.append(f"{self.reader.source}: {what}")

    def _check_rows(self) -> None:
        if not self.n_experts:
            return
        for m, layer in enumerate(self.table.expert_layers):
            rows = [self.rows.get((m, e), {}) for e in range(self.n_experts)]
            tensors = {t.name: t for row in rows for part, (t, *_) in row.items()
                       if not part.endswith("_bias")}  # biases stay float beside MXFP4
            if len({t.format == "mxfp4" for t in tensors.values()}) > 1:
                self._problem(next(iter(tensors)), f"layer '{layer}' mixes MXFP4 and dense "
                                                   f"routed experts")
            missing: dict[str, list[int]] = {}
            for e, row in enumerate(rows):
                if "gate_up" in row and ("gate" in row or "up" in row):
                    split = (row.get("gate") or row["up"])[0].name
                    self._problem(split, f"layer '{layer}' holds routed expert {e} in both the "
                                         f"fused and the per-expert layout ('{row['gate_up'][0].name}'"
                                         f" and '{split}')")
                for part in _missing_parts(row, self.part_shapes):
                    if (m, part) not in self.tried:
                        missing.setdefault(part, []).append(e)
            for part, es in missing.items():
                which = ("every routed expert" if len(es) == self.n_experts else
                         f"routed expert(s) {', '.join(map(str, es[:8]))}"
                         + (", ..." if len(es) > 8 else ""))
                self.problems.append(f"{self.reader.source}: missing tensor "
                                     f"{self._expert_names(layer, es[0], part)} (needed for "
                                     f"{which} of layer '{layer}')")

    def _expert_names(self, layer: str, e: int, part: str) -> str:
        names = [_quoted(self.table.expert_names(layer, part, expert)) for expert in (e, None)]
        if part == "gate_up":  # or the two halves
            halves = [self.table.expert_names(layer, p, e) for p in ("gate", "up")]
            names += [_quoted(pair, " and ") for pair in zip(*halves)]
        return " or ".join(n for n in names if n) or "(no rule of the table gives it)"

    def read_params(self, put) -> dict:
        """Every param read in threads and `put` in the table's order, here, in this thread: a
        put over a mesh that spans processes is a collective, which every process must issue in
        the same order."""
        put = put or (lambda path, a: a)

        def one(path: ParamPath) -> list[tuple[ParamPath, Any, bool]]:
            """(path, array, whether it goes through put) of each leaf the param fills."""
            tensor, rule = self.params[path]
            if path in self.host:
                return [(path, self.reader.keep(tensor.name), False)]
            if path in self.scale_of:  # FP8 as stored: values and scales on the dividing block
                values, scales = self.reader.keep(tensor.name)
                scales = fp8.scales_on_dividing_block(scales, values.shape,
                                                      self.reader.block_of(tensor.name))
                return [(path, values, True), (self.scale_of[path], scales, True)]
            a = self.reader.read(tensor.name)
            if rule.transform is not None:
                a = rule.transform.apply(a)
            return [(path, a.astype(np.dtype(self.specs[path].dtype), copy=False), True)]

        out: dict = {}
        for leaves in _in_threads(one, self.params):
            for path, value, placed in leaves:
                _set(out, path, put(path, value) if placed else value)
        return out

    def row_parts(self, row: int) -> dict:
        """The stored parts of expert row `row`, read from the files (gate / up / gate_up /
        down: arrays, or MXFP4 (blocks, scales))."""
        m, e = divmod(row, self.n_experts)
        parts = {}
        for part, (tensor, fused, transform) in self.rows[(m, e)].items():
            if fused:
                parts[part] = self.reader.read_row(tensor.name, e)
            elif tensor.format == "mxfp4":
                parts[part] = self.reader.read_mxfp4(tensor.name)
            else:
                parts[part] = self.reader.read(tensor.name)
            parts[part] = _transformed(parts[part], transform)
        return parts

    def read_experts(self, put_row) -> None:
        def one(row: int) -> None:
            put_row(row, _expert_row(self.row_parts(row)))

        for _ in _in_threads(one, range(len(self.table.expert_layers) * self.n_experts)):
            pass


def _in_threads(fn: Callable, items) -> Iterator:
    """fn over items in READ_WORKERS threads, results in order: the preads and numpy's copies
    and casts release the GIL, so the reads run in parallel."""
    with concurrent.futures.ThreadPoolExecutor(READ_WORKERS, "tidejax-load") as pool:
        yield from pool.map(fn, items)


def _set(tree: dict, path: ParamPath, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _missing_parts(row: Mapping[str, Any], declared: Mapping[str, Any]) -> list[str]:
    """What a row lacks: gate_up (or the missing half of gate + up), down, and the biases where
    they are `declared`."""
    need = []
    if "gate_up" not in row:
        halves = [p for p in ("gate", "up") if p not in row]
        need += halves if len(halves) == 1 else (["gate_up"] if halves else [])
    return need + [p for p in ("down", "gate_up_bias", "down_bias")
                   if p in declared and p not in row]


def _expert_row(parts: dict) -> dict:
    """{"gate_up", "down"} arrays, or the MXFP4 bank's blocks and scales for (blocks, scales)."""
    if "gate_up" in parts:
        gate_up = parts["gate_up"]
    elif isinstance(parts["gate"], tuple):
        gate_up = tuple(np.concatenate(pair) for pair in zip(parts["gate"], parts["up"]))
    else:
        gate_up = np.concatenate([parts["gate"], parts["up"]])
    down = parts["down"]
    biases = {k: parts[k] for k in ("gate_up_bias", "down_bias") if k in parts}
    if isinstance(gate_up, tuple):
        return {"gate_up_blocks": gate_up[0], "gate_up_scales": gate_up[1],
                "down_blocks": down[0], "down_scales": down[1], **biases}
    return {"gate_up": gate_up, "down": down, **biases}
