"""Where the disk tier reads its rows from (`open_rows`): the checkpoint in place where a row as
read is the row as served, else a prepared copy under state_dir, written once and reused.

A prepared copy is `state_dir/experts/<key>.rows` (row r at r * stride, its leaves back to back;
the stride is the row's bytes rounded up to disk.ALIGN, so each row is one direct read)
and its manifest `<key>.json`: the format, the layout, each source file's size and mtime, and the
copy's own. It is reused while the manifest matches the sources and the copy; otherwise it is
rebuilt (the reason logged, naming the file): written to a temporary file in threads with a
progress line, fsynced, renamed over, then the manifest written atomically (persist.write_atomic).
So a kill mid-write leaves no copy that a restart would take for whole.

Where the mesh spans several processes, each process reads only its shards of each row, always
from a prepared copy of them (a process's shards of a row are not one span of the checkpoint's
files: down's are columns), under `state_dir/experts/process<i>-tensor<T>/` (its process index
and the ways the mesh splits "tensor"), with the manifest and reuse above.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
from pathlib import Path

import jax
import numpy as np

from tidejax import parallel
from tidejax.checkpoint.progress import Progress
from tidejax.checkpoint.table import READ_WORKERS
from tidejax.errors import ConfigError
from tidejax.residency.disk import (ALIGN, CheckpointRows, Fingerprint, PreparedRows,
                                    ProcessShards, ShardsOf, aligned)
from tidejax.residency.persist import clear_torn, write_atomic
from tidejax.residency.pool import row_bytes as pool_row_bytes

log = logging.getLogger("tidejax.residency")

PREPARED_FORMAT = "tidejax-prepared-experts/2"  # /2: rows at ALIGN-aligned strides


def open_rows(rows: CheckpointRows, state_dir: str, key: str = "[residency] host budget",
              label: str = "", mesh=None):
    """The disk tier's rows: `rows` (read in place) where the held format is the files' (no FP8
    to dequantize, no cast or repack), else the PreparedRows of a copy under `state_dir`, its
    file named by the sources and format, then `label` (a drafting MTP layer's: "-mtp"). Where
    `mesh` (None: parallel.current_mesh) spans several processes: ProcessShards, this process's
    shards of the rows from a copy of them."""
    mesh = mesh or parallel.current_mesh()
    processes = parallel.process_count(mesh)
    if processes > 1:
        if not state_dir:
            raise ConfigError(f"{key}: across {processes} processes each reads its shards of the "
                              "experts from a prepared copy of them; set residency.state_dir")
        folder = (Path(state_dir) / "experts" /
                  f"process{jax.process_index()}-tensor{parallel.tensor_size(mesh)}")
        return ProcessShards(prepare(ShardsOf(rows, mesh), folder, label), rows.layout)
    source, fmt = rows.source, rows.fmt
    stored = source.empty_row()
    same = source.stored_as_read() and all(
        name in stored and stored[name].dtype == leaf.dtype for name, leaf in rows.layout.items())
    if same:
        log.info("residency: cold experts are read in place from %d checkpoint file(s)",
                 len(rows.files.prints))
        return rows
    if not state_dir:
        raise ConfigError(f"{key}: the experts are served in another layout than the checkpoint "
                          f"stores ({fmt.held_as}, {fmt.dtype}); set residency.state_dir for "
                          f"their prepared copy")
    return prepare(rows, Path(state_dir) / "experts", label)


def prepare(rows: CheckpointRows | ShardsOf, folder: Path, label: str = "") -> PreparedRows:
    """The prepared copy of `rows` under `folder` (its name ending in `label`): reused where its
    manifest matches, else (re)written."""
    sources = {str(p): f.as_json() for p, f in sorted(rows.files.prints.items())}
    layout = {k: [list(v.shape), str(np.dtype(v.dtype))] for k, v in rows.layout.items()}
    expected = {"format": PREPARED_FORMAT, "align": ALIGN, "held_as": rows.fmt.held_as,
                "dtype": str(rows.fmt.dtype), "layout": layout, "sources": sources}
    key = hashlib.sha256(json.dumps([sorted(sources), rows.fmt.held_as, str(rows.fmt.dtype)])
                         .encode()).hexdigest()[:16] + label
    path, manifest_path = folder / f"{key}.rows", folder / f"{key}.json"
    reason = _stale(path, manifest_path, expected)
    if reason is None:
        log.info("residency: reusing the prepared experts %s", path)
    else:
        log.info("residency: writing the prepared experts %s (%s)", path, reason)
        _write(rows, path)
        write_atomic(manifest_path, json.dumps(
            {**expected, "copy": Fingerprint.of(path).as_json()}, sort_keys=True).encode())
    return PreparedRows(path, rows.layout)


def _stale(path: Path, manifest_path: Path, expected: dict) -> str | None:
    """Why the copy at `path` cannot be reused (None: it can)."""
    if not manifest_path.is_file() or not path.is_file():
        return "none yet"
    try:
        saved = json.loads(manifest_path.read_bytes())
        copy = saved.pop("copy")
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{manifest_path} is unreadable"
    if saved.get("sources") != expected["sources"]:
        return "its checkpoint files changed since it was written"
    if saved != expected:
        return "it was written for another format"
    if copy != Fingerprint.of(path).as_json():
        return f"{path} changed or was cut short since it was written"
    return None


def _write(rows: CheckpointRows | ShardsOf, path: Path) -> None:
    """Every row read, converted and written at its offset of a temporary file, in threads;
    then fsync and rename over `path`."""
    clear_torn(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n, row_bytes = rows.source.n_rows, pool_row_bytes(rows.layout)
    stride = aligned(row_bytes)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    progress = Progress("preparing experts", n, n * row_bytes)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, n * stride)

        def one(row: int) -> None:
            arrays = rows.read(row)
            data = b"".join(np.ascontiguousarray(arrays[k], v.dtype).tobytes()
                            for k, v in rows.layout.items())
            os.pwrite(fd, data, row * stride)
            progress.advance(1, row_bytes)

        with concurrent.futures.ThreadPoolExecutor(READ_WORKERS, "tidejax-prepare") as pool:
            list(pool.map(one, range(n)))
        os.fsync(fd)
    finally:
        os.close(fd)
        progress.close()
    os.replace(tmp, path)

