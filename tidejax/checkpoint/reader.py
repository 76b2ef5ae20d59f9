"""CheckpointReader: a checkpoint directory (one model.safetensors, or shards listed by
model.safetensors.index.json) seen as one lazy name -> tensor map that records which tensors
were consumed, so a load can fail on anything left unmapped."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from tidejax.checkpoint.fp8 import BLOCK, dequantize_fp8_block, scale_shape
from tidejax.checkpoint.progress import Progress
from tidejax.checkpoint.safetensors_io import DTYPES, CheckpointError, SafetensorsFile

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"  # DeepSeek FP8: X.weight (e4m3) + X.weight_scale_inv (f32 blocks)
_E4M3 = DTYPES["F8_E4M3"]


class CheckpointReader:
    """Lazy access to a safetensors checkpoint.

    `path`: a directory holding model.safetensors.index.json (sharded) or model.safetensors,
    or the path of either file. Every header is read and checked at open (truncation,
    dtypes, duplicates, index consistency); tensor data is read only by `read`/`read_rows`.
    An FP8 pair `X.weight` + `X.weight_scale_inv` reads as one float32 tensor.
    """

    def __init__(self, path: str | os.PathLike, *, fp8_block: tuple[int, int] = BLOCK,
                 progress: bool = True, label: str = "loading weights"):
        self.source, files = _resolve(Path(path))
        self.fp8_block = tuple(fp8_block)
        # name -> its file (the index check has already ruled out a name in two shards)
        self._where: dict[str, SafetensorsFile] = {n: f for f in files for n in f.tensors}
        self._consumed: set[str] = set()
        self._check_fp8_pairs()
        infos = [f.tensors[n] for n, f in self._where.items()]
        self.progress = Progress(label, len(infos), sum(i.nbytes for i in infos),
                                 enabled=progress)

    # -- what is there ---------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def dtype(self, name: str) -> np.dtype:
        """The stored dtype (float8_e4m3fn for the weight of an FP8 pair)."""
        return self._info(name).dtype

    def file_of(self, name: str) -> Path:
        self._info(name)
        return self._where[name].path

    def is_fp8_pair(self, name: str) -> bool:
        return name + SCALE_SUFFIX in self._where and self._info(name).dtype == _E4M3

    # -- consumption ----------------------------------------------------------------------
    def claim(self, name: str, by: str = "") -> None:
        """Mark `name` (and its FP8 scale) consumed; a second claim is a duplicate mapping."""
        self._info(name)
        if name in self._consumed:
            raise CheckpointError(f"{self.file_of(name)}: tensor '{name}' is mapped twice"
                                  + (f" (again by {by})" if by else ""))
        self._consumed.add(name)
        if self.is_fp8_pair(name):
            self._consumed.add(name + SCALE_SUFFIX)

    def check_all_consumed(self, ignore: Iterable[str] = ()) -> None:
        """Fail naming every tensor that no rule consumed (claimed) and no `ignore` regex
        matches (re.search: anchor with ^ and $ as needed). May run before the reads, once
        everything is claimed; ignored tensors count as done on the progress line."""
        patterns = [re.compile(p) for p in ignore]
        unclaimed = [n for n in self.names() if n not in self._consumed]
        left = [n for n in unclaimed if not any(p.search(n) for p in patterns)]
        if left:
            self.progress.close()
            shown = "; ".join(f"'{n}' in {self.file_of(n)}" for n in left[:10])
            more = f" (and {len(left) - 10} more)" if len(left) > 10 else ""
            raise CheckpointError(f"{self.source}: {len(left)} unexpected tensor(s) that no "
                                  f"rule maps: {shown}{more}")
        self._consumed.update(unclaimed)  # ignored: done
        self.progress.advance(len(unclaimed), sum(self._info(n).nbytes for n in unclaimed))

    # -- reading --------------------------------------------------------------------------
    def read(self, name: str) -> np.ndarray:
        """The tensor as a fresh array (float32 for an FP8 pair); claims it if unclaimed."""
        if name not in self._consumed:
            self.claim(name)
        f = self._where[name]
        if self.is_fp8_pair(name):
            scale_name = name + SCALE_SUFFIX
            out = dequantize_fp8_block(f.view(name), self._where[scale_name].view(scale_name),
                                       self.fp8_block)
            self.progress.advance(2, f.tensors[name].nbytes
                                  + self._where[scale_name].tensors[scale_name].nbytes)
            return out
        out = np.array(f.view(name))
        self.progress.advance(1, f.tensors[name].nbytes)
        return out

    def read_rows(self, name: str) -> Iterator[np.ndarray]:
        """Tensor `name` one leading-axis row at a time (fresh arrays), so a stacked [E, ...]
        tensor is never copied whole. Not for FP8 pairs."""
        if self.is_fp8_pair(name):
            raise CheckpointError(f"{self.file_of(name)}: '{name}' is FP8 block-scaled; "
                                  f"read it whole")
        if name not in self._consumed:
            self.claim(name)
        f = self._where[name]
        view, nbytes = f.view(name), f.tensors[name].nbytes
        for i in range(view.shape[0]):
            row = np.array(view[i])
            self.progress.advance(int(i == view.shape[0] - 1), nbytes // view.shape[0])
            yield row

    def missing(self, name: str, wanted_by: str = "") -> CheckpointError:
        """The error for a tensor the model needs but the checkpoint lacks."""
        return CheckpointError(f"{self.source}: missing tensor '{name}'"
                               + (f" (needed for {wanted_by})" if wanted_by else ""))

    def _info(self, name: str):
        f = self._where.get(name)
        if f is None:
            raise self.missing(name)
        return f.tensors[name]

    def _check_fp8_pairs(self) -> None:
        """Every e4m3 tensor has its block scales, and every scale fits its weight."""
        for name, f in self._where.items():
            info = f.tensors[name]
            weight_name = name.removesuffix(SCALE_SUFFIX)
            if weight_name != name and weight_name in self._where:
                weight = self._info(weight_name)
                want = scale_shape(weight.shape, self.fp8_block) if len(weight.shape) == 2 else None
                if weight.dtype != _E4M3 or info.shape != want or info.dtype != np.float32:
                    raise CheckpointError(
                        f"{f.path}: '{name}' {info.dtype} {list(info.shape)} does not fit FP8 "
                        f"block scales of '{weight_name}' {weight.dtype} {list(weight.shape)} "
                        f"(expected a 2-D float8_e4m3fn weight and float32 {want} scales for "
                        f"{self.fp8_block} blocks)")
            elif info.dtype == _E4M3 and name + SCALE_SUFFIX not in self._where:
                raise CheckpointError(f"{f.path}: FP8 tensor '{name}' has no "
                                      f"'{name}{SCALE_SUFFIX}' block scales")


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
