"""One safetensors file, read lazily: the header is parsed and checked at open, tensor bytes
are read by pread into the caller's array, one tensor (or one row) at a time, from any number of
threads (the GIL is released while the kernel copies; a file cut short after open is an error
naming the tensor, not a SIGBUS), or memory-mapped as stored (`view`).

Format: 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data;
offsets are relative to the start of the data. numpy has no bf16 / float8 dtypes: ml_dtypes
supplies them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np

from tidejax.checkpoint.direct import DirectFile
from tidejax.errors import CheckpointError


# safetensors dtype name -> numpy dtype (little-endian, as the format stores them)
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("bool"),
}

MAX_HEADER_BYTES = 100 * 2**20  # the reference implementation's limit


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets into the file (header included)
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """The header of one .safetensors file, checked against the file's size, and lazy access
    to its tensors. Any inconsistency raises CheckpointError naming the file and tensor."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = _read_header(self.path)
        self._mmap: np.memmap | None = None
        self._fd = os.open(self.path, os.O_RDONLY)
        self._direct: DirectFile | None = None  # reads past the page cache (read_direct)

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def read_direct(self) -> bool:
        """From here, reads with O_DIRECT (checkpoint.direct) where the filesystem takes it:
        the residency disk tier's rows, which host memory must not hold twice. Whether it does."""
        if self._direct is None:
            self._direct = DirectFile(self.path)
        return self._direct.direct

    def read(self, name: str, row: int | None = None) -> np.ndarray:
        """Tensor `name` (or its leading-axis row `row`) as a fresh array, read by pread (past
        the page cache after read_direct)."""
        info = self.tensors[name]
        shape, begin = info.shape, info.begin
        if row is not None:
            shape = info.shape[1:]
            begin += row * (info.nbytes // info.shape[0])
        out = np.empty(shape, info.dtype)
        if self._direct is not None:
            out.reshape(-1).view(np.uint8)[:] = self._direct.read_span(begin, out.nbytes)
            return out
        buffer, done = memoryview(out.reshape(-1).view(np.uint8)), 0
        while done < out.nbytes:
            n = os.preadv(self._fd, [buffer[done:]], begin + done)
            if n == 0:
                raise _fail(self.path, f"truncated: tensor '{name}' ends at byte {info.end}, "
                                       f"the file now ends at {begin + done}")
            done += n
        return out

    def view(self, name: str) -> np.ndarray:
        """A read-only, file-backed view of tensor `name` (no copy)."""
        info = self.tensors[name]
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mmap[info.begin:info.end]
        return raw.view(info.dtype).reshape(info.shape)


def _fail(path: Path, msg: str) -> CheckpointError:
    return CheckpointError(f"{path}: {msg}")


def _no_duplicate_keys(pairs: list) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate tensor name '{key}' in the header")
        seen[key] = value
    return seen


def _read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _fail(path, f"truncated: {size} bytes, too short for a safetensors header")
            n = int.from_bytes(prefix, "little")
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise _fail(path, f"truncated or not safetensors: header length {n} "
                                  f"but the file has {size} bytes")
            text = f.read(n)
    except FileNotFoundError:
        raise _fail(path, "file not found") from None
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(path, f"header is not valid JSON ({e})") from None
    except ValueError as e:  # a duplicate name
        raise _fail(path, str(e)) from None
    if not isinstance(header, dict):
        raise _fail(path, "header is not a JSON object")
    start, data_size = 8 + n, size - 8 - n
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_info(path, name, entry, start, data_size)
    _check_no_overlap(path, tensors)
    return tensors


def _tensor_info(path: Path, name: str, entry, start: int, data_size: int) -> TensorInfo:
    where = f"tensor '{name}'"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise _fail(path, f"{where}: header entry needs dtype, shape and data_offsets")
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise _fail(path, f"{where}: unknown dtype '{entry['dtype']}' "
                          f"(known: {', '.join(DTYPES)})")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise _fail(path, f"{where}: bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise _fail(path, f"{where}: bad data_offsets {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise _fail(path, f"{where}: {end - begin} bytes for shape {shape} {entry['dtype']} "
                          f"(expected {expected})")
    if end > data_size:
        raise _fail(path, f"truncated: {where} ends at data byte {end} but the file holds "
                          f"only {data_size} data bytes")
    return TensorInfo(name, dtype, tuple(shape), start + begin, start + end)


def _check_no_overlap(path: Path, tensors: dict[str, TensorInfo]) -> None:
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.nbytes)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise _fail(path, f"tensors '{a}' and '{b}' overlap in the data")
