"""Routed experts on disk, one row at a time: read in place from the checkpoint's safetensors
files (`CheckpointRows`), or from a prepared copy under state_dir where the served layout differs
from the files' (`PreparedRows`, written once by residency/prepared.py). Both give
`read(row) -> {leaf: numpy array}` in the host pool's format and `layout` ({leaf:
ShapeDtypeStruct [rows, ...]}, what residency.pool's n_rows / row_bytes read).

Both read with O_DIRECT (checkpoint.direct.DirectFile: no page cache, so a budget of host
memory is what the tier holds there). A prepared copy's rows start at multiples of ALIGN, each
read into a page-aligned buffer whose leaves are the arrays handed back (no copy); a row in place
is read as the aligned span around each of its tensors' bytes, which are copied out. Where the
filesystem refuses O_DIRECT the files are read buffered, said once in the log and in `direct`
(the stats' `disk_direct`). `JoinedRows` serves two sources as one: the main model's rows,
then a drafting MTP layer's (runtime/build.py: those are memory-mapped, read through the page
cache), each read in place or from a prepared copy of its own (`joined`: across processes, the
ProcessShards of the two copies joined).

Where the mesh spans several processes each process reads only its shards of each row: a
prepared copy of them (`ShardsOf`, written by prepared.open_rows), served by `ProcessShards`,
whose read(row) gives the row's shards as this process's devices hold them in the host pool.

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
from tidejax.checkpoint.direct import ALIGN, DirectFile, aligned
from tidejax import parallel
from tidejax.contract import expert_axes
from tidejax.residency.pool import n_rows, pool_layout, row_bytes


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
        self.direct = source.read_direct()  # the weights are loaded: from here rows only

    def read(self, row: int) -> dict:
        self.files.check(self.source.files(row))
        return self.fmt.convert(self.source.read(row))


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


class JoinedRows:
    """The rows of `first`, then those of `then` (same leaves, shapes and dtypes), as one source
    of the disk tier: the main model's experts, then a drafting MTP layer's (runtime/build.py),
    so that turning speculation on or off keeps the main model's prepared copy."""

    def __init__(self, first, then):
        for name, leaf in first.layout.items():
            other = then.layout.get(name)
            if other is None or (other.shape[1:], other.dtype) != (leaf.shape[1:], leaf.dtype):
                raise ValueError(f"rows of another layout cannot be joined: {name!r} is "
                                 f"{leaf.shape[1:]} {leaf.dtype}, then {other}")
        self.first, self.then = first, then
        self.n_first = n_rows(first.layout)
        total = self.n_first + n_rows(then.layout)
        self.layout = {k: jax.ShapeDtypeStruct((total, *v.shape[1:]), v.dtype)
                       for k, v in first.layout.items()}
        self.where = f"{first.where}, then {then.where}"

    @property
    def direct(self) -> bool:
        return self.first.direct and self.then.direct

    def read(self, row: int) -> dict:
        if row < self.n_first:
            return self.first.read(row)
        return self.then.read(row - self.n_first)


class ShardsOf:
    """This process's shards of each row of `rows` (whole rows: CheckpointRows), where the mesh
    (`mesh`) spans several processes: the row in the host pool's layout (pool.pool_layout) cut
    as this process's devices hold it (parallel.local_indices). read(row) -> {leaf: [shards,
    *shard]}, the shards in the order of their devices' ids; `layout` {leaf:
    ShapeDtypeStruct [rows, shards, *shard]}: what prepared.prepare writes a copy of."""

    where = "checkpoint"

    def __init__(self, rows: CheckpointRows, mesh):
        self.rows, self.tensor = rows, parallel.tensor_size(mesh)
        self.files, self.fmt, self.source = rows.files, rows.fmt, rows.source
        axes = expert_axes(rows.layout, "experts")
        self.indices = {k: [index[1:] for index in parallel.local_indices(v.shape, axes[k], mesh)]
                        for k, v in rows.layout.items()}
        empty = {k: np.zeros(v.shape[1:], v.dtype) for k, v in rows.layout.items()}
        self.layout = layout_of(self._cut(empty), n_rows(rows.layout))

    def _cut(self, row: dict) -> dict:
        row = pool_layout(row, self.tensor)
        return {k: np.stack([row[k][index] for index in self.indices[k]]) for k in row}

    def read(self, row: int) -> dict:
        return self._cut(self.rows.read(row))


class ProcessShards:
    """The rows of a prepared copy of this process's shards (`copy`: PreparedRows of a ShardsOf
    layout) as the host cache's source: `layout` the whole rows' (as every source's: the budgets
    and the pool's shape read it), read(row) -> {leaf: [shards, *shard]} (ShardsOf's)."""

    where = "prepared copy of this process's shards"

    def __init__(self, copy: PreparedRows, layout: dict):
        self.copy, self.layout = copy, layout

    @property
    def direct(self) -> bool:
        return self.copy.direct

    def read(self, row: int) -> dict:
        return self.copy.read(row)


def joined(first, then):
    """The rows of `first`, then those of `then`, as one source (JoinedRows); across processes
    (both ProcessShards) a ProcessShards over their joined copies, so the host cache still reads
    them as this process's shards."""
    if isinstance(first, ProcessShards) and isinstance(then, ProcessShards):
        return ProcessShards(JoinedRows(first.copy, then.copy), JoinedRows(first, then).layout)
    return JoinedRows(first, then)
