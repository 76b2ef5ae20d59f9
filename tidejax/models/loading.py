"""Loading a family's weights: dense params onto the device (placed by their logical axes),
routed experts into a host pool.

`ExpertPool` receives each routed expert as a row (`put_row(layer * E + expert, row)`, from the
loader's reading threads) in the format the checkpoint holds it (dense {"gate_up", "down"} or MXFP4
blocks and scales) and stores it in the format the profile asks for, allocating on the first row:
no second copy of the experts is ever held. Given `place` (tidejax.residency.pool.host_pool), the
pool is placed in host memory first, zeroed, and each row is written into the placed buffers
through tidejax.parallel.shard_buffers (each of this process's shards, where the pool is split):
the pool is never held twice, not even while it is placed.
`load_by_table` loads a family's declared params by its checkpoint table; with dense_format "fp8"
the Linear weights the checkpoint stores FP8 are declared and kept as stored (fp8_specs).
"""

from __future__ import annotations

import logging
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tidejax import parallel
from tidejax.checkpoint import CheckpointReader, Rule, Table, fp8, load, mxfp4
from tidejax.contract import BIAS_KEYS
from tidejax.errors import ConfigError
from tidejax.models.base import ParamSpec, abstract, nbytes

log = logging.getLogger(__name__)


class RowFormat:
    """How routed-expert rows are held: held_as "checkpoint" (as stored; dense rows in `dtype`),
    "bf16" or "mxfp4". `convert` turns a row as the checkpoint table reads it into that format;
    the host pool and the residency disk tier both hold rows through it."""

    def __init__(self, held_as: str, dtype):
        self.held_as, self.dtype = held_as, np.dtype(dtype)
        self._quantize = jax.jit(mxfp4.quantize)  # on the device: numpy takes seconds an expert

    def joining(self, names) -> RowFormat:
        """The format a row takes to join rows of the leaves `names`: MXFP4 where this format
        keeps rows as stored and those are MXFP4 (a drafting MTP layer's float experts, stored
        per expert, beside the main model's MXFP4 ones), else this one."""
        if self.held_as == "checkpoint" and "gate_up_blocks" in names:
            return RowFormat("mxfp4", self.dtype)
        return self

    def convert(self, arrays: dict) -> dict:
        packed = "gate_up_blocks" in arrays
        biases = {k: np.asarray(arrays[k], np.float32) for k in BIAS_KEYS & set(arrays)}
        if self.held_as == "mxfp4" and not packed:
            out = dict(biases)
            for name in ("gate_up", "down"):
                w = np.asarray(arrays[name], np.float32)
                if w.shape[-1] % 32:
                    raise ConfigError(f"experts = 'mxfp4' needs input sizes that are multiples of "
                                      f"32; '{name}' has {w.shape[-1]}")
                out[f"{name}_blocks"], out[f"{name}_scales"] = (
                    np.asarray(a) for a in self._quantize(jnp.asarray(w)))
            return out
        if packed and self.held_as != "mxfp4" and self.held_as != "checkpoint":
            arrays = {name: mxfp4.dequantize(arrays[f"{name}_blocks"], arrays[f"{name}_scales"])
                      for name in ("gate_up", "down")} | biases
            packed = False
        if packed:
            return arrays
        dtype = np.dtype(jnp.bfloat16) if self.held_as == "bf16" else self.dtype
        return {k: np.asarray(v).astype(dtype, copy=False) for k, v in arrays.items()}


class ExpertPool:
    """held_as: "checkpoint" (as stored; dense rows in `dtype`), "bf16" or "mxfp4" (RowFormat).
    place: a dict of arrays [rows, ...] -> the same placed in host memory (None: the pool stays
    numpy)."""

    def __init__(self, rows: int, held_as: str, dtype, place=None):
        self.rows, self.format = rows, RowFormat(held_as, dtype)
        self.place = place
        self.pool: dict | None = None  # the numpy pool, or the placed one
        self._views: dict | None = None  # {name: [(index, numpy view)]} the rows are written into
        self._filled_in_numpy = False  # the pool is numpy, to be placed when filled
        self._lock = threading.Lock()

    def put_row(self, row: int, arrays: dict) -> None:
        arrays = self.format.convert(arrays)
        with self._lock:
            if self._views is None:
                self._allocate({k: (np.shape(v), np.asarray(v).dtype) for k, v in arrays.items()})
        if arrays.keys() != self._views.keys():  # an MTP layer's float row: as the pool's
            arrays = self.format.joining(self._views).convert(arrays)
        for k, v in arrays.items():
            for index, view in self._views[k]:  # each local shard of the placed pool, or numpy
                start, stop, _ = index[0].indices(self.rows)
                if start <= row < stop:
                    view[row - start] = v[index[1:]]

    def _allocate(self, rows: dict) -> None:
        """The pool, of `rows` {name: (row shape, dtype)}: placed zeros written in place, else
        numpy arrays placed at `result` (twice the experts' bytes while placed, logged)."""
        pool = {k: np.zeros((self.rows, *shape), dtype) for k, (shape, dtype) in rows.items()}
        self.pool = pool
        self._views = {k: [((slice(None),) * v.ndim, v)] for k, v in pool.items()}
        if self.place is not None:
            placed = self.place(pool)
            try:
                self._views = {k: parallel.shard_buffers(v) for k, v in placed.items()}
                self.pool = placed
            except ValueError as e:
                self._filled_in_numpy = True
                log.warning("the expert pool is filled in numpy, then placed: it is held twice "
                            "while placed (%s)", e)

    def result(self) -> dict:
        """The pool: placed where `place` was given, else numpy."""
        if self.pool is None:
            raise ConfigError("the checkpoint holds no routed experts")
        if self.place is not None and self._filled_in_numpy:  # no host buffer: placed now
            self.pool, self._views, self._filled_in_numpy = self.place(self.pool), None, False
        return self.pool


DENSE_FORMATS = ("float", "fp8")


def open_checkpoint(model_dir, raw_config: dict, table: Table) -> CheckpointReader:
    """`model_dir`'s reader (its headers read) on config.json's FP8 scale block and `table`'s."""
    return CheckpointReader(model_dir, fp8_block=fp8.config_block(raw_config),
                            fp8_blocks=table.fp8_blocks)


def load_by_table(model_dir, raw_config: dict, table: Table, param_specs: dict,
                  expert_specs: dict, put_row, host_specs: dict | None = None,
                  dense_format: str = "float", reader: CheckpointReader | None = None) -> dict:
    """Dense params (declared by `param_specs`: onto the device in their declared dtypes, placed
    by their declared logical axes through tidejax.parallel) and routed experts (rows of
    `expert_specs`, through `put_row`) by the family's checkpoint table, after every name and
    shape is checked against the headers. `host_specs`: tensors kept on the host as stored
    (memory-mapped), returned beside the params. dense_format "fp8": the Linear weights stored
    FP8 are declared as stored (fp8_specs) and kept so on the device. `reader`: the
    checkpoint's where the caller opened it already (open_checkpoint on `table`'s FP8 blocks),
    else opened here."""
    reader = reader or open_checkpoint(model_dir, raw_config, table)
    if dense_format not in DENSE_FORMATS:
        raise ConfigError(f"model.dense_format = {dense_format!r}: expected one of {DENSE_FORMATS}")
    if dense_format == "fp8":
        param_specs = fp8_specs(param_specs, stored_fp8(reader, table), reader)
        if not any(np.dtype(s.dtype) == _E4M3 for s in jax.tree.leaves(param_specs)):
            raise ConfigError(f"model.dense_format = 'fp8': {model_dir} stores no dense "
                              f"projection in FP8 (use 'float')")
    host_specs = host_specs or {}
    log.info("%s: %.2f GB of dense params, %.2f GB of routed experts, %.2f GB kept on the host "
             "(as declared)", model_dir, nbytes(param_specs) / 1e9, nbytes(expert_specs) / 1e9,
             nbytes(host_specs) / 1e9)
    return load(reader, table, abstract(param_specs), abstract(expert_specs),
                put=lambda path, array: parallel.put(array, _spec_at(param_specs, path).axes),
                put_row=put_row, host=abstract(host_specs))


_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def stored_fp8(reader: CheckpointReader, table: Table) -> dict[tuple, str]:
    """Param path -> the FP8 tensor (a weight with block scales) that a rule of `table` maps
    there, from the headers."""
    out = {}
    for name, tensor in reader.tensors.items():
        hits = [] if table.ignores(name) else table.matches(name)
        if tensor.format == "fp8" and len(hits) == 1 and isinstance(hits[0][0], Rule):
            out[tuple(hits[0][1].format(hits[0][2]).split("."))] = name
    return out


def fp8_specs(specs: dict, stored: dict[tuple, str], reader: CheckpointReader,
              prefix: tuple = ()) -> dict:
    """`specs` with every Linear ({"weight": [out, in]} alone) whose weight `stored` names
    declared as stored: {"weight": float8_e4m3fn, "scale": float32 on fp8.dividing_block}."""
    out = {}
    for key, spec in specs.items():
        path = (*prefix, key)
        if not isinstance(spec, dict):
            out[key] = spec
            continue
        name, weight = stored.get((*path, "weight")), spec.get("weight")
        if name is not None and set(spec) == {"weight"} and len(weight.shape) == 2:
            block = fp8.dividing_block(weight.shape, reader.block_of(name))
            out[key] = {"weight": ParamSpec(weight.shape, _E4M3, weight.axes),
                        "scale": ParamSpec([d // b for d, b in zip(weight.shape, block)],
                                           jnp.float32, (None, None), init="ones")}
        else:
            out[key] = fp8_specs(spec, stored, reader, path)
    return out


def _spec_at(specs: dict, path: tuple):
    """The ParamSpec at `path` (keys of nested dicts)."""
    for key in path:
        specs = specs[key]
    return specs
