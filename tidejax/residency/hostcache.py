"""The host pool as a cache over the experts on disk (residency.host_budget_experts): `capacity`
host slots, which row each holds, reads by demand and their commit between steps.

The pool keeps its place in the state (ExpertState.pool, leaves [capacity, ...] in host memory a
jit reads); `slot_of` [L_moe * E] maps a pool row (moe_layer * E + expert) to its host slot or -1
(on disk). The steps read the map from their SwapBatch (swap.apply_batch), so a row is read
through it wherever a step reads the pool (swaps, `exact`'s fetch, the bank's fill).

Where the model's mesh splits "tensor", each device's shard of a slot holds its slice of the
row's intermediate, as the loaded pool does (pool.pool_layout): a row read from disk is put in
that layout as it is read (once), and written into every shard of this process, and `exact`'s in-step read hands each device its shard of the
row (a callback per device). Across processes each process's cache reads only its shards
(disk.ProcessShards) and follows process 0's plans: process 0's reads and drops go to the peers
in its plans (`orders`, taken by its Runner), and each batch carries its map, which a peer's
cache is brought to before the batch applies (`follow`: a read that is late there is waited
for; the step's collectives hold process 0 at the same point), so every process holds the same
rows in the same slots at each step.

Reads run in a small thread pool, overlapped with the steps: `request` queues rows (the
planner's swaps that need a row not in host memory), `prefetch` the rows of most demand not in
host memory that would displace held rows of less (`worth_reading`), at most PREFETCH_DEPTH
queued at once; `read_now` is `exact`'s miss of a row on disk, called from inside the step by a
host callback (`fetch`), which waits for that row's read alone (queued or running already: its
future; else it reads it). A read row lands beside the pool and is written into a host slot by
`commit`, between steps: into a free slot at once (no map names one), over a held row only after
the steps in flight are done (a step may read any slot it maps: `exact`), evicting the rows of
least demand (the planner's decayed History) that the bank does not hold. A bank row is always
held in host memory too (the bank is refilled from the pool after a failed step:
Residency.rebuild).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time

import jax
import numpy as np

from tidejax import parallel
from tidejax.contract import expert_axes
from tidejax.residency.disk import ProcessShards
from tidejax.residency.pool import host_pool, n_rows, pool_layout, row_bytes

log = logging.getLogger("tidejax.residency")

READ_WORKERS = 4  # threads reading rows from disk
PREFETCH_DEPTH = 2 * READ_WORKERS  # reads queued or running a prefetch tops up to


class HostCache:
    def __init__(self, rows, capacity: int):
        """rows: residency.disk's CheckpointRows, PreparedRows, JoinedRows or (across
        processes) ProcessShards; capacity: host slots."""
        self.rows, self.capacity = rows, capacity
        # the bytes a read brings: this process's shards of a row, across processes
        self.row_bytes = row_bytes(rows.copy.layout if isinstance(rows, ProcessShards)
                                   else rows.layout)
        # the model's mesh (made inside its scope: the steps' maps are placed on it from the
        # scheduler's thread, which has none)
        self.mesh = parallel.current_mesh()
        self.pool = host_pool({k: np.zeros((capacity, *v.shape[1:]), v.dtype)
                               for k, v in rows.layout.items()}, self.mesh)
        self.tensor = parallel.tensor_size(self.mesh)  # the ways the mesh splits a row
        # each leaf's shards of this process, in the order of their devices' ids: (their index
        # in the leaf, a view of their bytes)
        self._shards = {k: parallel.shard_buffers(v) for k, v in self.pool.items()}
        # the position among those shards of the device at each place along "tensor"
        ours = sorted((d for d in self.mesh.devices.flat if d.process_index == jax.process_index()),
                      key=lambda d: d.id)
        self._shard_at = {list(self.mesh.devices.flat).index(d): i for i, d in enumerate(ours)}
        # process 0 across processes: its reads queued and rows dropped since its Runner last
        # took them, in order ([("read" | "drop", rows)]); None: no peers to tell
        self.orders: list | None = None
        # row -> host slot or -1; replaced, never changed in place, so a step's copy stays valid
        self.slot_of = np.full(n_rows(rows.layout), -1, np.int32)
        self.row_at = np.full(capacity, -1, np.int32)  # host slot -> row, or -1 (free)
        # reads, read_bytes, read_ns (the threads' time), busy_ns (wall time with a read
        # running), in_step (reads `exact`'s callback ran itself), waited (its waits for a
        # queued read), prefetched, evictions, dropped, commit_waits
        self.counters = collections.Counter()
        self.prefetched = np.zeros(len(self.slot_of), bool)  # held since a prefetch read it
        self.reads_by_row = np.zeros(len(self.slot_of), np.int64)  # reads from disk of each row
        self._lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}  # row -> its read
        self._landed: dict[int, dict] = {}  # row -> arrays read, not yet in a slot
        self._ahead: set[int] = set()  # rows queued or landed by `prefetch`
        self._running, self._busy_since = 0, 0
        self._threads = concurrent.futures.ThreadPoolExecutor(READ_WORKERS, "tidejax-disk")

    # -- reads (any thread) ---------------------------------------------------------------

    def _read(self, row: int) -> dict:
        """Row `row` from disk, in the host pool's layout (pool.pool_layout; across processes
        this process's shards of it, read so)."""
        with self._lock:
            t0 = time.perf_counter_ns()
            if not self._running:
                self._busy_since = t0
            self._running += 1
        try:
            arrays = self.rows.read(row)
        finally:
            with self._lock:
                t1 = time.perf_counter_ns()
                self._running -= 1
                if not self._running:
                    self.counters["busy_ns"] += t1 - self._busy_since
        with self._lock:
            self.counters["reads"] += 1
            self.reads_by_row[row] += 1
            self.counters["read_bytes"] += self.row_bytes
            self.counters["read_ns"] += t1 - t0
        return arrays if isinstance(self.rows, ProcessShards) else pool_layout(arrays, self.tensor)

    def fill(self, rows) -> None:
        """Boot: `rows` read (in threads) into the first slots; nothing else is read."""
        rows = [int(r) for r in rows]
        if len(rows) > self.capacity:
            raise ValueError(f"{len(rows)} rows do not fit {self.capacity} host slots")
        slot_of = self.slot_of.copy()
        for slot, (row, arrays) in enumerate(zip(rows, self._threads.map(self._read, rows))):
            self._write(slot, arrays)
            self.row_at[slot], slot_of[row] = row, slot
        self.slot_of = slot_of

    def request(self, rows) -> list[int]:
        """Queues reads of the rows neither in host memory nor read or being read; the rows
        queued."""
        queued = []
        with self._lock:
            for row in map(int, rows):
                if self.slot_of[row] < 0 and row not in self._pending and row not in self._landed:
                    self._pending[row] = self._threads.submit(self._read, row)
                    queued.append(row)
        self._tell("read", queued)
        return queued

    def _tell(self, order: str, rows) -> None:
        """Process 0: `rows` read or dropped, for its peers' caches (`orders`)."""
        if self.orders is not None and rows:
            self.orders.append((order, [int(r) for r in rows]))

    def take_orders(self) -> list:
        """Process 0: the orders since the last call, for its next plan (Runner)."""
        orders, self.orders = self.orders, []
        return orders

    def obey(self, orders) -> None:
        """A peer: process 0's orders, in order: its reads queued here too, its drops dropped
        (landed or queued: a read still running finishes in its thread, its rows unused)."""
        for order, rows in orders:
            if order == "read":
                self.request(rows)
            elif order == "drop":
                with self._lock:
                    for row in rows:
                        self._landed.pop(row, None)
                        self._pending.pop(row, None)
            else:
                raise ValueError(f"process 0 sent an unknown host cache order {order!r}")

    def worth_reading(self, demand: np.ndarray, pinned, hysteresis: float) -> list[int]:
        """The rows a read ahead brings in now (`worth_reading` below, over this cache)."""
        return worth_reading(self.row_at, demand, pinned, hysteresis, self.reading())

    def prefetch(self, rows) -> list[int]:
        """Reads ahead of the rows (worth_reading's, or `ring`'s misses), until PREFETCH_DEPTH
        reads are queued or running; the rows queued."""
        queued = self.request(prefetch_room(rows, self.queued))
        with self._lock:
            self._ahead.update(queued)
            self.counters["prefetched"] += len(queued)
        return queued

    def reading(self) -> set[int]:
        """The rows whose reads are queued, running or landed (not yet committed)."""
        with self._lock:
            return set(self._pending) | set(self._landed)

    def read_now(self, row: int) -> dict:
        """Row `row` now (`exact`'s miss of a row on disk): landed already, or waiting for its
        queued read alone, or read here; it lands for the next commit."""
        with self._lock:
            arrays, future = self._landed.get(row), self._pending.get(row)
            if arrays is None:
                self.counters["waited" if future is not None else "in_step"] += 1
        if arrays is None:
            try:
                arrays = future.result() if future is not None else self._read(row)
            except Exception:  # raised once: the row is read anew when next asked for
                with self._lock:
                    if future is not None and self._pending.get(row) is future:
                        del self._pending[row]
                        self._ahead.discard(row)
                raise
            with self._lock:
                self._landed[row] = arrays
                self._pending.pop(row, None)
        return arrays

    def fetch(self, row) -> dict:
        """Inside a jit: pool row `row` (traced) read from disk by a host callback that waits,
        one a device (parallel.over_tensor), each handing back its device's shard of the row."""
        shapes = {k: jax.ShapeDtypeStruct(shards[0][1].shape[1:], shards[0][1].dtype)
                  for k, shards in self._shards.items()}
        axes = {k: a[1:] for k, a in expert_axes(self.rows.layout, "experts").items()}

        def shard(row, at):
            return {k: parts[self._shard_at[int(at)]]
                    for k, parts in self._parts(self.read_now(int(row))).items()}

        def one(row):
            at = jax.lax.axis_index("tensor") if self.tensor > 1 else 0
            return (jax.pure_callback(shard, shapes, row, at),)
        return parallel.over_tensor(one, (None,), (axes,), self.mesh)(row)[0]

    @property
    def queued(self) -> int:
        """Reads queued or running."""
        with self._lock:
            return len(self._pending)

    def wait(self, rows) -> None:
        """Until the reads of `rows` that are queued have landed."""
        with self._lock:
            futures = [self._pending[r] for r in map(int, rows) if r in self._pending]
        for future in futures:
            future.result()

    # -- between steps --------------------------------------------------------------------

    def commit(self, demand: np.ndarray, pinned, protect, wait_steps) -> bool:
        """The rows landed so far into host slots: free slots first, then over the held rows of
        least demand (`demand` [L_moe * E], the planner's) that are not `pinned` (in the bank),
        rows in `protect` (wanted by queued swaps) last; a landed row of less demand than every
        such row is dropped, unless protected. `wait_steps()` is called before the first write
        over a held row (the steps in flight may read it; a free slot no map names). A failed
        read raises here, once (its row is read anew when next asked for). Whether the map
        changed."""
        with self._lock:
            for row, future in list(self._pending.items()):
                if future.done():
                    del self._pending[row]
                    try:
                        self._landed[row] = future.result()
                    except Exception:
                        self._ahead.discard(row)
                        self._tell("drop", [row])
                        raise
            landed, self._landed = self._landed, {}
            ahead = self._ahead & set(landed)
            self._ahead -= set(landed)
        held = [r for r in landed if self.slot_of[r] >= 0]
        landed = {r: a for r, a in landed.items() if self.slot_of[r] < 0}
        if not landed:  # every step comes here: nothing to place, no victims to rank
            self._tell("drop", held)
            return False
        placed, evicted, dropped = place_landed(self.row_at, list(landed), demand, pinned,
                                                protect)
        self._tell("drop", held + sorted(set(landed) - {row for _, row in placed}))
        self.counters["evictions"] += evicted
        self.counters["dropped"] += dropped
        if evicted:  # a held row is overwritten: no step in flight may still read it
            wait_steps()
            self.counters["commit_waits"] += 1
        slot_of = self.slot_of.copy()
        for slot, row in placed:
            if self.row_at[slot] >= 0:
                slot_of[self.row_at[slot]] = -1
                self.prefetched[self.row_at[slot]] = False
            self._write(slot, landed[row])
            self.row_at[slot], slot_of[row] = row, slot
            self.prefetched[row] = row in ahead
        self.slot_of = slot_of
        return True

    def follow(self, slot_of: np.ndarray, wait_steps) -> bool:
        """A peer: the cache brought to process 0's map `slot_of` (a batch's host_slots) before
        the batch applies: each row the map places in a slot that holds another is written
        there from its landed or queued read (waited for: a late read holds this process, and
        the step's collectives process 0), else read here; `wait_steps()` first where a held
        row is overwritten. A failed read is read once more here; a second failure raises
        before any slot is written (the peer stops: process 0 reports it lost). Whether the map
        changed."""
        slot_of = np.asarray(slot_of, np.int32)
        if np.array_equal(slot_of, self.slot_of):
            return False
        moves = [(int(slot_of[r]), int(r)) for r in np.nonzero(slot_of >= 0)[0]
                 if self.row_at[slot_of[r]] != r]
        read = {row: self._take(row) for _, row in moves}  # all first: a failure changes nothing
        if any(self.row_at[slot] >= 0 for slot, _ in moves):
            wait_steps()
            self.counters["commit_waits"] += 1
        for slot, row in moves:
            self._write(slot, read[row])
        row_at, held = np.full(self.capacity, -1, np.int32), np.nonzero(slot_of >= 0)[0]
        row_at[slot_of[held]] = held
        self.row_at, self.slot_of = row_at, slot_of.copy()
        with self._lock:  # a held row landed again (a step in flight read it): not kept twice
            self._landed = {r: a for r, a in self._landed.items() if slot_of[r] < 0}
        return True

    def _take(self, row: int) -> dict:
        """A peer: row `row`'s read (landed, or its queued read waited for, else read here)."""
        with self._lock:
            arrays, future = self._landed.pop(row, None), self._pending.pop(row, None)
        if arrays is None and future is not None:
            try:
                arrays = future.result()
            except Exception as e:  # noqa: BLE001 (read once more below; a second failure raises)
                log.warning("residency: reading expert row %d failed (%s); reading it again", row, e)
        return self._read(row) if arrays is None else arrays

    def _parts(self, arrays: dict) -> dict:
        """{leaf: [this process's shards of row `arrays` (as _read gives it), in _shards'
        order]}."""
        if isinstance(self.rows, ProcessShards):  # read as shards already
            return {k: list(v) for k, v in arrays.items()}
        # the slots whole in each shard: index[0] is every row
        return {k: [arrays[k][index[1:]] for index, _ in shards]
                for k, shards in self._shards.items()}

    def _write(self, slot: int, arrays: dict) -> None:
        """A row (as read) into host slot `slot`: this process's shards of it."""
        parts = self._parts(arrays)
        for k, shards in self._shards.items():
            for (_, view), part in zip(shards, parts[k]):
                view[slot] = part

    def stats(self) -> dict:
        return disk_stats(self.counters, self.queued, self.rows.direct,
                          int((self.row_at >= 0).sum()))


def disk_stats(counters, queued: int = 0, direct: bool = False, held: int = 0) -> dict:
    """The disk tier's stats (Residency.stats, so /metrics) from a HostCache's counters; with
    an empty Counter, the zeros of an engine without one."""
    c = counters
    return {"disk_reads": c["reads"], "disk_read_bytes": c["read_bytes"],
            "disk_read_seconds": c["read_ns"] / 1e9,  # the reading threads' time
            # bytes over the wall time with a read running: the tier's delivered bandwidth
            "disk_read_gbps": c["read_bytes"] / c["busy_ns"] if c["busy_ns"] else 0.0,
            "disk_reads_queued": queued, "disk_direct": int(direct),
            "disk_reads_in_step": c["in_step"], "disk_read_waits_in_step": c["waited"],
            "disk_prefetches": c["prefetched"],
            "host_evictions": c["evictions"], "host_reads_dropped": c["dropped"],
            "host_commit_waits": c["commit_waits"], "host_held": held}


def worth_reading(row_at: np.ndarray, demand: np.ndarray, pinned, hysteresis: float, busy
                  ) -> list[int]:
    """The rows on disk a read ahead brings in (HostCache.prefetch at a drain; simulate replays
    it), most demand first: `row_at` [capacity] the row each host slot holds (-1: free); each
    would take a free slot, or the place of a held row the bank does not hold (`pinned`) whose
    `demand` is below 1 / `hysteresis` of its own, pairing the busiest rows on disk with the
    least busy held ones; not those in `busy` (queued or landed already)."""
    busy, pinned = set(map(int, busy)), set(map(int, pinned))
    free = int((row_at < 0).sum())
    held = [int(r) for r in row_at if r >= 0 and int(r) not in pinned]
    held.sort(key=lambda r: demand[r])  # the least demand first
    on_disk = np.ones(len(demand), bool)
    on_disk[row_at[row_at >= 0]] = False
    cold = np.nonzero(on_disk & (demand > 0))[0]
    out = []
    for row in cold[np.argsort(-demand[cold], kind="stable")]:
        row = int(row)
        if row in busy:
            continue
        if free:
            free -= 1
        elif held and demand[row] >= hysteresis * demand[held[0]]:
            held.pop(0)
        else:
            break
        out.append(row)
    return out


def prefetch_room(rows, queued: int) -> list[int]:
    """The first of `rows` a read ahead queues with `queued` reads queued or running: up to
    PREFETCH_DEPTH in all (HostCache.prefetch; simulate replays it)."""
    return [int(r) for r in list(rows)[:max(0, PREFETCH_DEPTH - queued)]]


def place_landed(row_at: np.ndarray, landed, demand: np.ndarray, pinned, protect
                 ) -> tuple[list[tuple[int, int]], int, int]:
    """Where rows read from disk go (HostCache.commit; simulate replays it): `row_at` [capacity]
    the row each host slot holds (-1: free); free slots first, then over the held rows of least
    `demand` not `pinned` (in the bank), rows in `protect` (wanted by queued swaps) last; a
    landed row of less demand than every such row is dropped, unless protected. -> ([(slot,
    row)] in write order, evictions, dropped)."""
    pinned, protect = set(map(int, pinned)), set(map(int, protect))
    free = [int(s) for s in np.nonzero(row_at < 0)[0]][::-1]
    victims = sorted((int(s) for s in np.nonzero(row_at >= 0)[0]
                      if int(row_at[s]) not in pinned),
                     key=lambda s: (int(row_at[s]) in protect, demand[row_at[s]]),
                     reverse=True)  # the least valuable last: popped first
    placed, evicted, dropped = [], 0, 0
    for row in sorted(map(int, landed), key=lambda r: (r in protect, demand[r]), reverse=True):
        if free:
            placed.append((free.pop(), row))
        elif victims and (row in protect or demand[row_at[victims[-1]]] <= demand[row]):
            placed.append((victims.pop(), row))
            evicted += 1
        else:
            dropped += 1
    return placed, evicted, dropped
