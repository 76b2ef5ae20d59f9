"""Routing traces from live traffic: the router's picks, with their weights, of sampled steps,
written under state_dir in a bounded set of chunk files (issue 36). Off by default.

Profile keys ([residency]):
    trace_every_steps = 0   # 0: off; N: every N-th step is recorded (its step index % N == 0)
    trace_max_mib = 64      # the chunks' total size bound; the oldest chunks go first
Tracing needs a state_dir (a ConfigError otherwise).

The format (version 1), stable; readers use `read_trace(folder)`:

    <state_dir>/routing/header.json    written atomically when the recorder starts:
        format             "tidejax-routing-trace"
        version            1
        model              the served model's name (model.served_name, else the checkpoint
                           folder's name)
        model_type         config.json's model_type
        n_layers           L: the MoE layers (the rows of the resident map and the counters)
        n_experts          E: routed experts per MoE layer
        top_k              k: picks per token and MoE layer
        trace_every_steps  the sampling period
        resident_slots     the bank's resident slots (budget_experts as resolved; = L * E when
                           every expert is resident)
        residency          the [residency] table the engine ran with (budget, geometry,
                           miss_policy, drain_every, half_life, hysteresis, ...)
    <state_dir>/routing/trace-<first step, 12 digits>.npz    chunks, np.savez (no pickles: read
        with allow_pickle=False), each written atomically (temp file, fsync, os.replace):
        step        int64 [R]       the engine's step index of each recorded step (Residency's
                                    `steps` counter before the step: the numbering of stats())
        tokens      int32 [R]       real tokens the step routed (its prompt chunk's, then its
                                    decoding lanes'; padding left out)
        map_version int64 [R]       the version of the resident map the step ran on
        ids         int16 [N, L, k] picked expert ids in the router's order (best choice score
                                    first; a correction bias shifts the choice, not the
                                    weights, so weights need not descend); N = tokens.sum(),
                                    record r's rows start at tokens[:r].sum()
        weights     float32 [N, L, k]  the router's weights of those picks (what the demand
                                    counters sum: History.demand's unit)
        resident    bool [N, L, k]  whether the pick's expert had a bank slot (resident or ring)
                                    when the step routed it; False: a miss, served by the policy

Recorded steps are the engine's serving steps and its scoring forwards (Engine.logits, the
boot's calibration), as the counters count them. A header that differs from the running
engine's (another model, geometry or [residency] setting) sets the old folder aside as
`routing.old-<unix time>` with one warning. A chunk is written when the records it holds reach a
quarter of trace_max_mib (at most CHUNK_BYTES) and at Engine.close(); before a chunk is written
the oldest chunks are removed until the folder stays within trace_max_mib (a chunk larger than
the whole bound, one step of many tokens under a tiny bound, is dropped with a warning). A trace
recorded at every step, counted per (layer, expert), is the demand the engine counted and
drained (tests/residency/test_trace.py).
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from tidejax.residency.persist import clear_torn, write_atomic
from tidejax.residency.state import Picks

log = logging.getLogger("tidejax.residency")

FORMAT, VERSION = "tidejax-routing-trace", 1
CHUNK_BYTES = 4 << 20  # a chunk's records at most before it is written
FIELDS = ("step", "tokens", "map_version", "ids", "weights", "resident")


def trace_folder(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / "routing"


class TraceRecorder:
    """Records every `every`-th step's picks (Residency.after_step hands it each step's Picks,
    still on the device: a sampled step's start toward the host and are read at the next call,
    never waiting), cutting them into chunk files under `folder` within `max_bytes`."""

    def __init__(self, folder: Path, header: dict, every: int, max_bytes: int):
        self.folder, self.every, self.max_bytes = folder, every, max_bytes
        self.chunk_bytes = min(CHUNK_BYTES, max(1, max_bytes // 4))
        self.header = {"format": FORMAT, "version": VERSION, **header, "trace_every_steps": every}
        self._pending = None  # (step, map version, Picks on their way to the host)
        self._records: list[tuple] = []  # (step, tokens, version, ids, weights, resident)
        self._buffered = 0  # bytes in _records
        self._open()

    def _open(self) -> None:
        """The header written, or an existing one of the same engine kept (chunks append); an
        existing folder of another engine set aside."""
        header = self.folder / "header.json"
        clear_torn(header)
        if header.exists():
            try:
                same = json.loads(header.read_text()) == self.header
            except (OSError, ValueError):
                same = False
            if not same:
                aside = self.folder.with_name(f"{self.folder.name}.old-{int(time.time())}")
                os.replace(self.folder, aside)
                log.warning("routing trace: %s was written by another engine or geometry; set "
                            "aside as %s, a new trace starts", self.folder, aside)
        for torn in self.folder.glob(".trace-*.tmp"):
            torn.unlink()
        write_atomic(header, json.dumps(self.header, indent=1, sort_keys=True).encode())

    def after_step(self, step: int, picks: Picks, version: int) -> None:
        """Step `step`'s picks (on the device): the previous sampled step's are read first."""
        self.flush()
        if step % self.every == 0:
            for leaf in (picks.ids, picks.weights, picks.resident):
                leaf.copy_to_host_async()
            self._pending = (step, version, picks)

    def flush(self) -> None:
        """Reads the sampled step still on its way to the host (waits for it)."""
        if self._pending is None:
            return
        step, version, picks = self._pending
        self._pending = None
        ids = np.asarray(picks.ids)
        live = ids[:, 0, 0] >= 0  # [rows]: the step's tokens (padding and unused rows are -1)
        record = (step, int(live.sum()), version, ids[live].astype(np.int16),
                  np.asarray(picks.weights)[live], np.asarray(picks.resident)[live])
        self._records.append(record)
        self._buffered += sum(a.nbytes for a in record[3:])
        if self._buffered >= self.chunk_bytes:
            self.write_chunk()

    def write_chunk(self) -> None:
        """The records held, as one chunk file, the oldest chunks removed to stay in bound."""
        if not self._records:
            return
        records, self._records, self._buffered = self._records, [], 0
        columns = list(zip(*records))
        arrays = dict(step=np.asarray(columns[0], np.int64),
                      tokens=np.asarray(columns[1], np.int32),
                      map_version=np.asarray(columns[2], np.int64),
                      ids=np.concatenate(columns[3]), weights=np.concatenate(columns[4]),
                      resident=np.concatenate(columns[5]))
        data = io.BytesIO()
        np.savez(data, **arrays)
        data = data.getvalue()
        if len(data) > self.max_bytes:
            log.warning("routing trace: a chunk of %d bytes (steps %d..%d) is above "
                        "trace_max_mib alone; dropped", len(data), arrays["step"][0],
                        arrays["step"][-1])
            return
        chunks = chunk_files(self.folder)
        sizes = [p.stat().st_size for p in chunks]
        while chunks and sum(sizes) + len(data) > self.max_bytes:
            chunks.pop(0).unlink()
            sizes.pop(0)
        write_atomic(self.folder / f"trace-{arrays['step'][0]:012d}.npz", data)

    def close(self) -> None:
        self.flush()
        self.write_chunk()


def chunk_files(folder: Path) -> list[Path]:
    """The chunks of a trace folder, oldest first."""
    return sorted(folder.glob("trace-*.npz"))


def read_trace(folder: str | os.PathLike) -> tuple[dict, dict]:
    """(header, arrays): the trace under `folder` (a state_dir's routing/), its chunks' arrays
    concatenated in step order (the format above); a ValueError naming the file where one is
    not a routing trace."""
    folder = Path(folder)
    path = folder / "header.json"
    try:
        header = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: no routing trace header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: no routing trace header (not a JSON object)")
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise ValueError(f"{path}: format {header.get('format')!r} version "
                         f"{header.get('version')!r}, expected {FORMAT!r} {VERSION}")
    for field in ("n_layers", "n_experts", "top_k", "trace_every_steps"):
        if type(header.get(field)) is not int or header[field] < 1:
            raise ValueError(f"{path}: field '{field}' should be a positive integer")
    parts = {name: [] for name in FIELDS}
    for chunk in chunk_files(folder):
        try:
            with np.load(chunk, allow_pickle=False) as npz:
                read = {name: npz[name] for name in FIELDS if name in npz.files}
        except Exception as e:  # a torn or foreign file: named
            raise ValueError(f"{chunk}: not a routing trace chunk ({type(e).__name__}: "
                             f"{e})") from None
        missing = set(FIELDS) - set(read)
        if missing:
            raise ValueError(f"{chunk}: not a routing trace chunk (no {sorted(missing)[0]!r})")
        for name in FIELDS:
            parts[name].append(read[name])
    shape = (0, header["n_layers"], header["top_k"])
    empty = dict(step=np.zeros(0, np.int64), tokens=np.zeros(0, np.int32),
                 map_version=np.zeros(0, np.int64), ids=np.zeros(shape, np.int16),
                 weights=np.zeros(shape, np.float32), resident=np.zeros(shape, bool))
    return header, {name: np.concatenate(parts[name]) if parts[name] else empty[name]
                    for name in FIELDS}
