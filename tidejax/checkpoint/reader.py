"""CheckpointReader: a checkpoint directory (one model.safetensors, or shards listed by
model.safetensors.index.json) seen as one lazy map of tensors as the model sees them: a weight and
its block scales are one tensor. Every header, pair and scale shape is checked at open; tensor
data is read only by `read`, `read_rows` and `read_mxfp4`, or kept as stored, memory-mapped, by
`keep`.

Stored tensors that make one logical tensor (`Tensor.parts`: the data first, then the scales):
  fp8   `X.weight` float8_e4m3fn + `X.weight_scale_inv` (DeepSeek-V3, float32) or `X.scale`
        (DeepSeek-V4.1, e8m0) per `fp8_block` (rows, cols) block, or the block `fp8_blocks` gives
        names that match one of its regexes (DeepSeek-V4.1's Engram tables: 1 x 32); reads as
        float32, or kept as stored with `keep`.
  mxfp4 `X_blocks` uint8 [..., G, 16] + `X_scales` e8m0 [..., G] (gpt-oss layout): tensor `X`
        [..., G * 32]; or `X.weight` uint8 / int8 [..., n / 2] (two e2m1 codes a byte, low nibble
        first) + `X.scale` e8m0 [..., n / 32] (DeepSeek-V4.1's FP4 experts): tensor `X.weight`
        [..., n]. Reads as float32, or as (blocks, scales) with `read_mxfp4` / `read_row`.
  plain every other stored tensor, as stored.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from tidejax.checkpoint import mxfp4
from tidejax.checkpoint.fp8 import (BLOCK, SCALE_DTYPES, dequantize_fp8_block, scale_names,
                                    scale_shape, scales_to_float32)
from tidejax.checkpoint.progress import Progress
from tidejax.errors import CheckpointError
from tidejax.checkpoint.safetensors_io import SafetensorsFile, TensorInfo

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
_CODES = (np.dtype(np.uint8), np.dtype(np.int8))  # packed e2m1 codes
_MX_SCALES = (np.dtype(np.uint8), _E8M0)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A checkpoint tensor as the model sees it: logical (dequantized) shape, format ("plain",
    "fp8" or "mxfp4") and the stored tensors that hold it, data first."""

    name: str
    shape: tuple[int, ...]
    format: str
    parts: tuple[str, ...]


class CheckpointReader:
    """Lazy access to a safetensors checkpoint.

    `path`: a directory holding model.safetensors.index.json (sharded) or model.safetensors,
    or the path of either file. `tensors`: logical name -> Tensor; `names()`, `shape`, `dtype`
    and `file_of` speak of the stored tensors. Errors are CheckpointError naming file and tensor.
    """

    def __init__(self, path: str | os.PathLike, *, fp8_block: tuple[int, int] = BLOCK,
                 fp8_blocks: Mapping[str, tuple[int, int]] | None = None,
                 progress: bool = True, label: str = "loading weights"):
        self.source, files = _resolve(Path(path))
        self.fp8_block = tuple(fp8_block)
        self._fp8_blocks = [(re.compile(rx), tuple(b)) for rx, b in (fp8_blocks or {}).items()]
        # name -> its file (the index check has already ruled out a name in two shards)
        self._where: dict[str, SafetensorsFile] = {n: f for f in files for n in f.tensors}
        self.tensors: dict[str, Tensor] = self._pair()
        infos = [self._info(n) for n in self._where]
        self.progress = Progress(label, len(infos), sum(i.nbytes for i in infos),
                                 enabled=progress)
        self._rows_lock = threading.Lock()
        self._rows_left: dict[str, int] = {}  # rows of each tensor read_row has not given yet

    def read_direct(self) -> bool:
        """Every file read with O_DIRECT from here (SafetensorsFile.read_direct); whether all
        of them are."""
        return all([f.read_direct() for f in set(self._where.values())])

    # -- what is there (stored tensors) ----------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def dtype(self, name: str) -> np.dtype:
        return self._info(name).dtype

    def file_of(self, name: str) -> Path:
        """The file of stored tensor `name`, or of the data of logical tensor `name`."""
        tensor = self.tensors.get(name)
        return self._path(tensor.parts[0] if tensor is not None else name)

    # -- reading --------------------------------------------------------------------------
    def read(self, name: str) -> np.ndarray:
        """Tensor `name` as a fresh array: float32 for fp8 and mxfp4 tensors, as stored for
        plain ones; a stored part of a pair (the scales, the blocks) reads raw."""
        tensor = self._tensor(name)
        if tensor.format == "fp8":
            weight, scales = (self._read(p) for p in tensor.parts)
            out = dequantize_fp8_block(weight, scales_to_float32(scales), self.block_of(name))
        elif tensor.format == "mxfp4":
            out = mxfp4.dequantize(*self._mxfp4_arrays(tensor))
        else:
            out = self._read(name)
        self.done(tensor)
        return out

    def keep(self, name: str) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Tensor `name` as stored, memory-mapped (nothing copied but fp8 scales): the array of a
        plain tensor, (float8_e4m3fn values, float32 scales) of an fp8 one."""
        tensor = self._tensor(name)
        if tensor.format == "mxfp4":
            raise CheckpointError(f"{self.file_of(name)}: '{name}' is MXFP4; read it")
        views = tuple(self._view(p) for p in tensor.parts)
        out = (views[0], scales_to_float32(views[1])) if tensor.format == "fp8" else views[0]
        self.done(tensor)
        return out

    def block_of(self, name: str) -> tuple[int, int]:
        """The (rows, cols) scale block of fp8 weight `name`."""
        return next((b for rx, b in self._fp8_blocks if rx.fullmatch(name)), self.fp8_block)

    def read_mxfp4(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """An mxfp4 tensor as stored: (blocks uint8 [..., G, 16], scales uint8 [..., G])."""
        tensor = self._tensor(name)
        if tensor.format != "mxfp4":
            raise CheckpointError(f"{self.file_of(name)}: '{name}' is {tensor.format}, not MXFP4")
        out = self._mxfp4_arrays(tensor)
        self.done(tensor)
        return out

    def read_row(self, name: str, row: int) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Leading-axis row `row` of tensor `name` as stored, a fresh array, so a stacked [E, ...]
        tensor is never copied whole: an array for a plain tensor, (blocks, scales) for an mxfp4
        one. Not for fp8 tensors (their scale blocks span rows). Safe from several threads; the
        tensor counts as done on the progress bar when all its rows have been read."""
        tensor = self._tensor(name)
        if tensor.format == "fp8":
            raise CheckpointError(f"{self.file_of(name)}: '{name}' is FP8 block-scaled; "
                                  f"read it whole")
        if tensor.format == "mxfp4":
            out = self._mxfp4_arrays(tensor, row)
        else:
            out = self._read(name, row)
        n, nbytes = self.shape(tensor.parts[0])[0], self._nbytes(tensor)
        # Counted after the read and under one lock with the bar, so the row that finishes the
        # tensor is counted last; it also carries the bytes that nbytes // n leaves over.
        with self._rows_lock:
            left = self._rows_left[name] = self._rows_left.get(name, n) - 1
            self.progress.advance(len(tensor.parts) if left == 0 else 0,
                                  nbytes // n + (nbytes % n if left == 0 else 0))
        return out

    def done(self, tensor: Tensor) -> None:
        """Count `tensor` as done on the progress line (read, or ignored unread)."""
        self.progress.advance(len(tensor.parts), self._nbytes(tensor))

    def later(self, tensors) -> None:
        """Takes `tensors` off the progress line: they are read after the load, as needed."""
        tensors = list(tensors)
        self.progress.leave_out(sum(len(t.parts) for t in tensors),
                                sum(self._nbytes(t) for t in tensors))

    # -- internals ------------------------------------------------------------------------
    def _file(self, name: str) -> SafetensorsFile:
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"{self.source}: missing tensor '{name}'")
        return f

    def _path(self, name: str) -> Path:
        return self._file(name).path

    def _info(self, name: str) -> TensorInfo:
        return self._file(name).tensors[name]

    def _view(self, name: str) -> np.ndarray:
        return self._file(name).view(name)

    def _read(self, name: str, row: int | None = None) -> np.ndarray:
        return self._file(name).read(name, row)

    def _tensor(self, name: str) -> Tensor:
        tensor = self.tensors.get(name)
        if tensor is None:  # a stored part of a pair, read raw
            tensor = Tensor(name, self.shape(name), "plain", (name,))
        return tensor

    def _nbytes(self, tensor: Tensor) -> int:
        return sum(self._info(p).nbytes for p in tensor.parts)

    def _mxfp4_arrays(self, tensor: Tensor, row: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
        """(blocks uint8 [..., G, 16], scales uint8 [..., G]) of an mxfp4 tensor (or its row)."""
        codes, scales = (self._read(p, row) for p in tensor.parts)
        blocks = codes.view(np.uint8).reshape(*scales.shape, mxfp4.BLOCK // 2)
        return blocks, scales.view(np.uint8)

    def _pair(self) -> dict[str, Tensor]:
        """Logical tensors from the stored ones; every pair checked on the headers."""
        tensors: dict[str, Tensor] = {}
        paired: set[str] = set()
        for name in self._where:
            tensor = self._fp8(name) or self._mxfp4(name)
            if tensor is not None:
                if tensor.name != name and tensor.name in self._where:
                    raise CheckpointError(f"{self._path(name)}: '{tensor.name}' is stored "
                                          f"both as it is and as '{name}'")
                tensors[tensor.name] = tensor
                paired.update(tensor.parts)
        for name in self._where:
            if name in paired:
                continue
            self._check_stray_scales(name)
            tensors[name] = Tensor(name, self.shape(name), "plain", (name,))
        return tensors

    def _fp8(self, name: str) -> Tensor | None:
        info = self._info(name)
        if info.dtype != _E4M3:
            return None
        scale = next((s for s in scale_names(name) if s in self._where), None)
        if scale is None:
            raise CheckpointError(f"{self._path(name)}: FP8 tensor '{name}' has no "
                                  f"'{scale_names(name)[0]}' (or '{scale_names(name)[1]}') "
                                  f"block scales")
        s = self._info(scale)
        block = self.block_of(name)
        want = scale_shape(info.shape, block) if len(info.shape) == 2 else None
        if s.shape != want or s.dtype not in SCALE_DTYPES:
            raise CheckpointError(
                f"{self._path(scale)}: '{scale}' {s.dtype} {list(s.shape)} does not fit FP8 "
                f"block scales of '{name}' {info.dtype} {list(info.shape)} (expected a 2-D "
                f"float8_e4m3fn weight and {want} scales of "
                f"{', '.join(map(str, SCALE_DTYPES))} for {block} blocks)")
        return Tensor(name, info.shape, "fp8", (name, scale))

    def _mxfp4(self, name: str) -> Tensor | None:
        info = self._info(name)
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            scale, logical = base + "_scales", base
            if scale not in self._where:
                raise CheckpointError(f"{self._path(name)}: MXFP4 blocks '{name}' have no "
                                      f"'{scale}'")
            ok = info.dtype == np.uint8 and info.shape[-1:] == (mxfp4.BLOCK // 2,)
            groups = info.shape[:-1]
        elif (info.dtype in _CODES and name.endswith(".weight")
              and scale_names(name)[1] in self._where):
            scale, logical = scale_names(name)[1], name
            n = info.shape[-1] if info.shape else 0
            ok = n % (mxfp4.BLOCK // 2) == 0
            groups = (*info.shape[:-1], n // (mxfp4.BLOCK // 2))
        else:
            return None
        s = self._info(scale)
        if not ok or s.shape != groups or s.dtype not in _MX_SCALES:
            raise CheckpointError(
                f"{self._path(name)}: MXFP4 '{name}' {info.dtype} {list(info.shape)} and "
                f"'{scale}' {s.dtype} {list(s.shape)} do not pair (want uint8 codes, 16 bytes a "
                f"block of 32, and uint8 / e8m0 scales {list(groups)})")
        return Tensor(logical, (*groups[:-1], groups[-1] * mxfp4.BLOCK) if groups else (),
                      "mxfp4", (name, scale))

    def _check_stray_scales(self, name: str) -> None:
        """Scales whose weight is there but not quantized (an unpaired `_scales` is an error)."""
        if name.endswith("_scales"):
            raise CheckpointError(f"{self._path(name)}: MXFP4 scales '{name}' have no "
                                  f"'{name.removesuffix('_scales')}_blocks'")
        weight = name.removesuffix("_scale_inv")
        if weight != name and weight in self._where:
            raise CheckpointError(
                f"{self._path(name)}: '{name}' does not fit FP8 block scales of '{weight}' "
                f"{self.dtype(weight)} {list(self.shape(weight))} (expected a 2-D "
                f"float8_e4m3fn weight)")


def _resolve(path: Path) -> tuple[Path, list[SafetensorsFile]]:
    """(the file that names the checkpoint, its opened safetensors files)."""
    if path.is_dir():
        if (path / INDEX).exists():
            path = path / INDEX
        elif (path / SINGLE).exists():
            path = path / SINGLE
        else:
            raise CheckpointError(f"{path}: no {INDEX} or {SINGLE} in this directory")
    if path.name.endswith(".json"):
        return path, _open_index(path)
    return path, [SafetensorsFile(path)]


def _open_index(path: Path) -> list[SafetensorsFile]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: not a safetensors index with a 'weight_map' "
                              f"({e!r})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: 'weight_map' is not an object")
    shards: dict[str, SafetensorsFile] = {}
    for name, shard in weight_map.items():
        if shard not in shards:
            if not (path.parent / shard).is_file():
                raise CheckpointError(f"{path}: shard '{shard}' (holding tensor '{name}') "
                                      f"not found in {path.parent}")
            shards[shard] = SafetensorsFile(path.parent / shard)
        if name not in shards[shard].tensors:
            raise CheckpointError(f"{shards[shard].path}: missing tensor '{name}' "
                                  f"(listed in {path.name})")
    for shard, f in shards.items():
        for name in f.tensors:
            if name not in weight_map:
                raise CheckpointError(f"{f.path}: tensor '{name}' is not listed in {path.name}")
            if weight_map[name] != shard:
                raise CheckpointError(f"{f.path}: duplicate tensor '{name}', which {path.name} "
                                      f"puts in {weight_map[name]}")
    return list(shards.values())
