"""Routed experts on disk, one row at a time: read in place from the checkpoint's safetensors
files (`CheckpointRows`), or from a prepared copy under state_dir where the served layout differs
from the files' (`PreparedRows`, written once by residency/prepared.py). Both give
`read(row) -> {leaf: numpy array}` in the host pool's format and `layout` ({leaf:
ShapeDtypeStruct [rows, ...]}, what residency.pool's n_rows / row_bytes read).

A prepared copy is read with O_DIRECT (`DirectFile`): its rows start at multiples of ALIGN, and
each is read into a page-aligned buffer whose leaves are the arrays handed back (no page cache, no
copy). Where the filesystem refuses O_DIRECT (tmpfs on kernels before 6.6, some network
filesystems) the file is read buffered, said once in the log and in `direct` (the stats'
`disk_direct`). Rows read in place from a checkpoint go through its reader's buffered preads
(their offsets are the safetensors file's, not aligned).

Every file is fingerprinted (size, mtime, inode) when it is opened; a read from a file that has
changed or been cut short since is refused with a CheckpointError naming it, before any of its
bytes are used (a row of the old layout read at the new file's offsets would be silent garbage).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from pathlib import Path

import jax
import numpy as np

from tidejax.errors import CheckpointError
from tidejax.residency.pool import row_bytes

log = logging.getLogger("tidejax.residency")

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and buffers (a page; >= logical blocks)


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
    direct = False  # the checkpoint reader's buffered preads

    def __init__(self, source, fmt):
        self.source, self.fmt = source, fmt
        self.layout = layout_of(fmt.convert(source.empty_row()), source.n_rows)
        self.files = Files(source.files())

    def read(self, row: int) -> dict:
        self.files.check(self.source.files(row))
        return self.fmt.convert(self.source.read(row))


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of ALIGN."""
    return -(-nbytes // ALIGN) * ALIGN


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A uint8 array of `nbytes` (rounded up to ALIGN) starting at an ALIGN-aligned address."""
    raw = np.empty(aligned(nbytes) + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip:skip + aligned(nbytes)]


class DirectFile:
    """One file read with O_DIRECT into page-aligned buffers, or buffered where the filesystem
    refuses O_DIRECT (at open or at the first read: EINVAL), which is logged once."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.direct = hasattr(os, "O_DIRECT")
        self._fd = None
        self._fd = self._open()

    def _open(self) -> int:
        if self.direct:
            try:
                return os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._buffered(e)
        return os.open(self.path, os.O_RDONLY)

    def _buffered(self, why: OSError) -> None:
        self.direct = False
        log.warning("residency: %s refuses O_DIRECT (%s); its rows are read buffered, through "
                    "the page cache", self.path, why.strerror)

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def read(self, begin: int, nbytes: int) -> np.ndarray:
        """Bytes [begin, begin + nbytes) (begin a multiple of ALIGN) as a uint8 array at an
        aligned address; CheckpointError naming the file where it ends before them."""
        out, done = aligned_buffer(nbytes), 0
        while done < nbytes:
            try:
                n = os.preadv(self._fd, [memoryview(out[done:])], begin + done)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                self._buffered(e)
                os.close(self._fd)
                self._fd = None
                self._fd = self._open()
                continue
            if n == 0:
                raise CheckpointError(f"{self.path}: truncated: bytes up to {begin + nbytes} "
                                      f"are read, the file ends at {begin + done}")
            done += n
        return out[:nbytes]


class PreparedRows:
    """Rows of a prepared copy: row r's leaves back to back at r * stride (row_bytes rounded up
    to ALIGN), in `layout`'s order, each row read by one direct read (DirectFile) whose buffer
    the arrays are views of."""

    where = "prepared"

    def __init__(self, path: Path, layout: dict):
        self.path, self.layout = Path(path), layout
        self.row_bytes = row_bytes(layout)
        self.stride = aligned(self.row_bytes)
        self.files = Files([self.path])
        self.file = DirectFile(self.path)

    @property
    def direct(self) -> bool:
        return self.file.direct

    def read(self, row: int) -> dict:
        self.files.check([self.path])
        data, out, at = self.file.read(row * self.stride, self.row_bytes), {}, 0
        for k, v in self.layout.items():
            n = int(np.prod(v.shape[1:])) * np.dtype(v.dtype).itemsize
            out[k] = data[at:at + n].view(v.dtype).reshape(v.shape[1:])
            at += n
        return out
