"""The prompt cache's host and disk tiers, behind the device pool's prefix index (kv/pages.py).

A page the device pool evicts from its prefix index leaves as a `Spilled` entry: its rows of the
pool and, for a family whose lanes keep state beside the pool (DeepSeek-V4.1, V4), the lane
snapshot taken at its end. The host tier keeps entries in host memory under their block hash,
least recently used first out, within `cache.host_gib`: their pages pinned (jax arrays in
pinned_host memory, copied there from the device and back with no pageable copy between) where
one process holds the mesh and its backend has pinned_host (runtime/runner.py pinned_pages), else
numpy, as the lane snapshots are. What it pushes out goes to the disk tier, which writes each
entry to a file of its own on a background thread (a temporary file renamed into place: a reader
never sees half a file), with a BLAKE2b digest of its bytes checked on every read (a file that
fails it is removed and skipped, one log line), least recently used out within
`cache.disk_gib`, and finds its files again at start (the file's name is the hash). A match
takes an entry out of the host tier (it goes back into the device pool); a disk file
stays. Raw bytes, not orbax-checkpoint: faster on a page (docs/DESIGN.md has the figures).

On a mesh over several processes every process keeps tiers of its own (runtime/runner.py): an
entry's leaves split over the processes are this process's shards (parallel.LocalShards), and
its files are its own, in a folder of its process index.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import queue
import struct
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tidejax.parallel import LocalShards

log = logging.getLogger("tidejax")

_MAGIC = b"TJXPAGE1"
_SUFFIX = ".page"


@dataclasses.dataclass
class Spilled:
    """An evicted page: its pool rows (the pool's tree, leaves [1, page_size, ...]) and the lane
    snapshot at its end (a steps.SavedSequence) or None; the leaves numpy, jax arrays in pinned
    host memory (the pages of a pinned spill) or this process's parallel.LocalShards of a leaf
    split over processes."""

    pages: object
    snapshot: object | None = None

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in jax.tree.leaves((self.pages, self.snapshot)))


class HostTier:
    """Entries in host memory within `budget` bytes, least recently put first out
    (`on_evict(digest, entry)` takes each one pushed out)."""

    def __init__(self, budget: int, on_evict):
        self.budget, self.bytes, self.evictions = budget, 0, 0
        self._entries: collections.OrderedDict[bytes, Spilled] = collections.OrderedDict()
        self._on_evict = on_evict

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def has_snapshot(self, digest: bytes) -> bool:
        return self._entries[digest].snapshot is not None

    def put(self, digest: bytes, entry: Spilled) -> None:
        if digest in self._entries:  # evicted from the device again: the newest copy
            self.take(digest)
        self._entries[digest] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.budget:
            old, gone = self._entries.popitem(last=False)
            self.bytes -= gone.nbytes
            self.evictions += 1
            self._on_evict(old, gone)

    def take(self, digest: bytes) -> Spilled:
        entry = self._entries.pop(digest)
        self.bytes -= entry.nbytes
        return entry

    def drain(self) -> list[tuple[bytes, Spilled]]:
        """Every entry, oldest first; the tier is left empty."""
        items, self._entries, self.bytes = list(self._entries.items()), collections.OrderedDict(), 0
        return items


class DiskTier:
    """Entries in files under `folder` within `budget` bytes. `template`: a Spilled with a
    snapshot (None where the family has none) of jax.ShapeDtypeStruct leaves, or LocalShards of
    them (parallel.host_shapes): the shapes a file must have."""

    def __init__(self, folder: Path, budget: int, template: Spilled):
        self.folder, self.budget, self.evictions = Path(folder), budget, 0
        self.written = 0  # files written since start
        self._template = template
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # digest -> (file bytes, has a snapshot), least recently used first
        self._index: collections.OrderedDict[bytes, tuple[int, bool]] = collections.OrderedDict()
        self.bytes = 0
        self._rebuild()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="tidejax-disk-tier",
                                        daemon=True)
        self._writer.start()

    def _path(self, digest: bytes) -> Path:
        return self.folder / (digest.hex() + _SUFFIX)

    def _rebuild(self) -> None:
        """The index from the files left by an earlier run, oldest used first (temporary files
        of an interrupted write are removed)."""
        for tmp in self.folder.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        found = []
        for path in self.folder.glob("*" + _SUFFIX):
            try:
                digest = bytes.fromhex(path.stem)
                with open(path, "rb") as f:
                    header = _read_header(f)
                found.append((path.stat().st_mtime_ns, digest, path.stat().st_size,
                              header["snapshot"]))
            except (OSError, ValueError, KeyError) as e:
                log.warning("prompt cache: disk entry %s unreadable (%s): skipped and removed",
                            path, e)
                path.unlink(missing_ok=True)
        for _, digest, size, snapshot in sorted(found):
            self._index[digest] = (size, snapshot)
            self.bytes += size
        if found:
            log.info("prompt cache: %d pages on disk under %s (%.1f MiB)", len(found),
                     self.folder, self.bytes / 2**20)

    def __contains__(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def has_snapshot(self, digest: bytes) -> bool | None:
        """Whether its entry holds a lane snapshot; None where there is none (one look under
        the lock: the writer thread may evict between two)."""
        with self._lock:
            held = self._index.get(digest)
            return None if held is None else held[1]

    def entry_bytes(self, snapshot: bool) -> int:
        """The bytes of one entry's file, its header included, with or without a lane snapshot."""
        arrays = self._specs(snapshot)[2]
        payload = sum(int(np.prod(array.shape)) * jnp.dtype(array.dtype).itemsize
                      for array in arrays)
        return len(_MAGIC) + 4 + len(_header(snapshot, arrays, "0" * 32)) + payload

    def put(self, digest: bytes, entry: Spilled) -> None:
        """Writes `entry` on the background thread (nothing where the hash has a file)."""
        if digest not in self:
            self._queue.put((digest, entry))

    def read(self, digest: bytes) -> Spilled | None:
        """The entry on file, or None where it is gone or fails its digest (then removed, with a
        log line: never served)."""
        path = self._path(digest)
        try:
            with open(path, "rb") as f:
                header = _read_header(f)
                payload = f.read()
            if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["digest"]:
                raise ValueError("digest mismatch")
            entry = self._unpack(header, payload)
        except (OSError, ValueError, KeyError) as e:
            log.warning("prompt cache: disk entry %s is corrupt or unreadable (%s): skipped and "
                        "removed", path, e)
            self._forget(digest)
            path.unlink(missing_ok=True)
            return None
        with self._lock:
            if digest in self._index:
                self._index.move_to_end(digest)
        with contextlib.suppress(OSError):  # gone meanwhile (the writer's budget): served anyway
            os.utime(path)  # least recently used order survives a restart
        return entry

    def flush(self) -> None:
        """Waits for the writes queued so far."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join()

    # -- the writer thread -------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # a failed write loses a cached page, nothing else
                log.exception("prompt cache: writing a page to %s failed", self.folder)
            finally:
                self._queue.task_done()

    def _write(self, digest: bytes, entry: Spilled) -> None:
        leaves = [np.ascontiguousarray(array) for leaf in jax.tree.leaves((entry.pages,
                                                                           entry.snapshot))
                  for array in _arrays(leaf)]
        payload = b"".join(leaf.tobytes() for leaf in leaves)
        header = _header(entry.snapshot is not None, leaves,
                         hashlib.blake2b(payload, digest_size=16).hexdigest())
        if digest in self:  # queued twice
            return
        path = self._path(digest)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(_MAGIC + struct.pack("<I", len(header)) + header + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        size = path.stat().st_size
        with self._lock:
            self._index[digest] = (size, entry.snapshot is not None)
            self.bytes += size
            self.written += 1
            doomed = []
            while self.bytes > self.budget and self._index:
                old, (old_size, _) = self._index.popitem(last=False)
                self.bytes -= old_size
                self.evictions += 1
                doomed.append(old)
        for old in doomed:
            self._path(old).unlink(missing_ok=True)

    def _forget(self, digest: bytes) -> None:
        with self._lock:
            if digest in self._index:
                self.bytes -= self._index.pop(digest)[0]

    def _specs(self, snapshot: bool) -> tuple[list, object, list]:
        """The template's leaves (with its snapshot's or without), their tree, and the arrays a
        file holds of them (_arrays)."""
        template = self._template if snapshot else Spilled(self._template.pages)
        specs, treedef = jax.tree.flatten((template.pages, template.snapshot))
        return specs, treedef, [array for spec in specs for array in _arrays(spec)]

    def _unpack(self, header: dict, payload: bytes) -> Spilled:
        """The entry's leaves in the template's tree; a file of other shapes (another model's
        pages, a truncated write) raises ValueError."""
        specs, treedef, want = self._specs(header["snapshot"])
        if header["leaves"] != _leaves(want):
            raise ValueError("shapes unlike this model's pages")
        arrays, at = [], 0
        for array in want:
            dtype = jnp.dtype(array.dtype)
            size = int(np.prod(array.shape)) * dtype.itemsize
            arrays.append(np.frombuffer(payload, dtype, size // dtype.itemsize, at)
                          .reshape(array.shape))
            at += size
        if at != len(payload):
            raise ValueError("payload length unlike the shapes")
        read = iter(arrays)
        leaves = [LocalShards(spec.shape, spec.sharding, tuple(
            (device, next(read)) for device, _ in spec.shards))
            if isinstance(spec, LocalShards) else next(read) for spec in specs]
        pages, snapshot = jax.tree.unflatten(treedef, leaves)
        return Spilled(pages, snapshot)


def _arrays(leaf) -> list:
    """The arrays a file holds of a leaf: the leaf, or each of this process's shards of it."""
    return [data for _, data in leaf.shards] if isinstance(leaf, LocalShards) else [leaf]


def _header(snapshot: bool, arrays: list, digest: str) -> bytes:
    """A file's header: whether it holds a lane snapshot, its arrays' dtypes and shapes (numpy
    arrays or jax.ShapeDtypeStruct), the payload's digest (hex)."""
    return json.dumps({"snapshot": snapshot, "leaves": _leaves(arrays), "digest": digest}).encode()


def _leaves(arrays: list) -> list:
    """The header's description of arrays: [[dtype name, shape], ...]."""
    return [[jnp.dtype(array.dtype).name, list(array.shape)] for array in arrays]


def _read_header(f) -> dict:
    head = f.read(len(_MAGIC) + 4)
    if len(head) < len(_MAGIC) + 4 or head[:len(_MAGIC)] != _MAGIC:
        raise ValueError("not a tidejax page file")
    (length,) = struct.unpack("<I", head[len(_MAGIC):])
    return json.loads(f.read(length))


class Tiers:
    """The host tier and, where configured, the disk tier: what the device pool evicts goes to
    the host tier, what the host tier pushes out to the disk tier (straight there where the host
    budget is 0)."""

    def __init__(self, host_bytes: int, disk: DiskTier | None):
        self.disk = disk
        self.host = HostTier(host_bytes, self._to_disk)
        self.hits = collections.Counter()  # tier -> entries a restore wrote back from it

    def _to_disk(self, digest: bytes, entry: Spilled) -> None:
        if self.disk is not None:
            self.disk.put(digest, entry)

    def spill(self, digest: bytes, entry: Spilled) -> None:
        self.host.put(digest, entry)

    def run(self, digests: list[bytes], snapshots: bool) -> list[bytes]:
        """The longest run of `digests` from the first that the tiers hold; with `snapshots`, of
        the longest such run whose last entry has a lane snapshot."""
        held = []
        for digest in digests:
            if digest in self.host:
                held.append((digest, self.host.has_snapshot(digest)))
                continue
            snapshot = None if self.disk is None else self.disk.has_snapshot(digest)
            if snapshot is None:
                break
            held.append((digest, snapshot))
        while snapshots and held and not held[-1][1]:
            held.pop()
        return [digest for digest, _ in held]

    def load(self, digests: list[bytes]) -> list[tuple[bytes, str, Spilled]]:
        """(digest, tier, entry) of `digests` from the first, up to the first the tiers do not
        hold or whose disk file fails its check: taken out of the host tier, read from disk (the
        file stays)."""
        out = []
        for digest in digests:
            if digest in self.host:
                out.append((digest, "host", self.host.take(digest)))
                continue
            entry = (self.disk.read(digest) if self.disk is not None and digest in self.disk
                     else None)
            if entry is None:
                break
            out.append((digest, "disk", entry))
        return out

    def stats(self) -> dict:
        """Per tier (host; disk where there is one) the entries and bytes it holds now, the
        entries restores wrote back from it (`hits`) and those it pushed out (`evictions`)."""
        tiers = {"host": self.host} if self.disk is None else {"host": self.host,
                                                               "disk": self.disk}
        return {name: {"pages": len(tier), "bytes": tier.bytes, "hits": self.hits[name],
                       "evictions": tier.evictions} for name, tier in tiers.items()}

    def close(self) -> None:
        """The host tier's entries written to disk (where there is one) and the writes waited
        for: a restart finds them."""
        if self.disk is None:
            return
        for digest, entry in self.host.drain():
            self.disk.put(digest, entry)
        self.disk.close()
        log.info("prompt cache: %d pages written to disk under %s since start; %d there now "
                 "(%.1f MiB)", self.disk.written, self.disk.folder, len(self.disk),
                 self.disk.bytes / 2**20)


def model_key(model_dir: Path, page_size: int, template: Spilled, tensor: int,
              processes: int) -> str:
    """A folder name for one model's disk entries: block hashes cover token ids alone, so pages
    of another checkpoint, page size or dtype must never match (its config.json, its files'
    names, sizes and times, the page's leaves: `template`'s jax.ShapeDtypeStruct), nor those of
    another `tensor` split (its values are summed over another number of shards: a page from
    another layout would not give the tokens this one computes) or over another number of
    `processes` (an entry holds one process's shards)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"tensor {tensor} over {processes} processes;".encode())
    h.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            stat = path.stat()
            h.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    specs = jax.tree.leaves((template.pages, template.snapshot))
    h.update(repr([(str(s.dtype), s.shape) for s in specs]).encode() + str(page_size).encode())
    return h.hexdigest()
