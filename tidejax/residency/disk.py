"""Routed experts on disk, one row at a time: read in place from the checkpoint's safetensors
files (`CheckpointRows`), or from a prepared copy under state_dir where the served layout differs
from the files' (`PreparedRows`, written once by residency/prepared.py). Both give
`read(row) -> {leaf: numpy array}` in the host pool's format and `layout` ({leaf:
ShapeDtypeStruct [rows, ...]}, what residency.pool's n_rows / row_bytes read).

Every file is fingerprinted (size, mtime, inode) when it is opened; a read from a file that has
changed or been cut short since is refused with a CheckpointError naming it, before any of its
bytes are used (a row of the old layout read at the new file's offsets would be silent garbage).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np

from tidejax.errors import CheckpointError
from tidejax.residency.pool import row_bytes


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    size: int
    mtime_ns: int
    inode: int

    @staticmethod
    def of(path: Path) -> "Fingerprint":
        st = os.stat(path)
        return Fingerprint(st.st_size, st.st_mtime_ns, st.st_ino)

    def as_json(self) -> dict:
        return {"size": self.size, "mtime_ns": self.mtime_ns}


class Files:
    """The fingerprints of files as first opened, and the check that they still hold."""

    def __init__(self, paths):
        self.prints = {Path(p): Fingerprint.of(Path(p)) for p in paths}

    def check(self, paths) -> None:
        for path in paths:
            path, was = Path(path), self.prints[Path(path)]
            try:
                now = Fingerprint.of(path)
            except FileNotFoundError:
                raise CheckpointError(f"{path}: removed since it was opened; restart to load the "
                                      f"experts again") from None
            if now != was:
                how = ("truncated" if now.size < was.size else "changed")
                raise CheckpointError(f"{path}: {how} since it was opened ({was.size} -> "
                                      f"{now.size} bytes, mtime {was.mtime_ns} -> {now.mtime_ns});"
                                      f" its experts are not read; restart to load them again")


def layout_of(row: dict, n_rows: int) -> dict:
    """{leaf: ShapeDtypeStruct [n_rows, ...]} of rows shaped as `row`."""
    return {k: jax.ShapeDtypeStruct((n_rows, *np.shape(v)), np.asarray(v).dtype)
            for k, v in row.items()}


class CheckpointRows:
    """Rows read in place from the checkpoint (checkpoint.table.RowSource: preads at the
    tensors' safetensors offsets), in the pool's format (`fmt`: models.loading.RowFormat)."""

    where = "checkpoint"

    def __init__(self, source, fmt):
        self.source, self.fmt = source, fmt
        self.layout = layout_of(fmt.convert(source.empty_row()), source.n_rows)
        self.files = Files(source.files())

    def read(self, row: int) -> dict:
        self.files.check(self.source.files(row))
        return self.fmt.convert(self.source.read(row))


class PreparedRows:
    """Rows of a prepared copy: row r's leaves back to back at r * row_bytes, in `layout`'s
    order, read by os.preadv into fresh numpy arrays."""

    where = "prepared"

    def __init__(self, path: Path, layout: dict):
        self.path, self.layout = Path(path), layout
        self.row_bytes = row_bytes(layout)
        self.files = Files([self.path])
        self._fd = os.open(self.path, os.O_RDONLY)

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def read(self, row: int) -> dict:
        self.files.check([self.path])
        out = {k: np.empty(v.shape[1:], v.dtype) for k, v in self.layout.items()}
        buffers = [memoryview(a.reshape(-1).view(np.uint8)) for a in out.values()]
        begin, done = row * self.row_bytes, 0
        while done < self.row_bytes:
            n = os.preadv(self._fd, _from(buffers, done), begin + done)
            if n == 0:
                raise CheckpointError(f"{self.path}: truncated: row {row} ends at byte "
                                      f"{begin + self.row_bytes}, the file at {begin + done}")
            done += n
        return out


def _from(buffers: list, skip: int) -> list:
    """The buffers past their first `skip` bytes (a short preadv resumes there)."""
    out = []
    for b in buffers:
        if skip >= len(b):
            skip -= len(b)
            continue
        out.append(b[skip:])
        skip = 0
    return out
