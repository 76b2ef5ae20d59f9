"""What the engine's device and host do with a miss, on the host's numpy, for `simulate`'s
replay (residency/simulate.py): the `ring` policy's copies (residency/ring.py), `auto`'s choice
of the misses the host computes (serve.py `_exact_picks`) and the host cache over the disk
(residency/hostcache.py: its placement and its read ahead are the engine's own `place_landed`,
`worth_reading` and `prefetch_room`). Each follows the engine's order of events within a step;
where the engine's timing is the machine's (a disk read landing), the assumption is said where
it is made.
"""

from __future__ import annotations

import numpy as np

from tidejax.residency.hostcache import place_landed, prefetch_room, worth_reading


class RingModel:
    """ring.py's state on the host: `rows` [ring_slots] the row each ring slot holds (-1: empty),
    `chosen` [R] the rows the next step fetches (ring_rows), `staged` [R] the rows the last step
    fetched (ring_staged_rows), `next` the ring slot the next copy takes."""

    def __init__(self, slots: int, per_step: int):
        self.rows = np.full(slots, -1, np.int64)
        self.chosen = np.full(per_step, -1, np.int64)
        self.staged = np.full(per_step, -1, np.int64)
        self.next = 0

    def leave(self, row: int) -> None:
        """A planner swap took `row` into a resident slot: its ring slot empties (swap._swap)."""
        self.rows[self.rows == row] = -1

    def held(self, size: int) -> np.ndarray:
        """[size] bool: the rows in ring slots."""
        held = np.zeros(size, bool)
        held[self.rows[self.rows >= 0]] = True
        return held

    def start(self, resident: np.ndarray, on: bool) -> int:
        """A step's start after its swaps (ring.start): the staged rows not in the bank
        (`resident` [L * E] bool, or a ring slot) written into ring slots, oldest first, then
        the chosen rows fetched; the rows written."""
        written = 0
        if on:
            in_bank = resident | self.held(resident.size)
            for row in self.staged[self.staged >= 0]:
                if not in_bank[row]:
                    self.rows[self.next] = row
                    self.next = (self.next + 1) % len(self.rows)
                    written += 1
            self.staged = self.chosen.copy()
        return written

    def choose(self, in_bank: np.ndarray, approx: np.ndarray, on: bool) -> None:
        """A step's end (ring.choose): its misses of most substituted routing weight (`approx`
        [L * E] float32) neither in the bank (`in_bank` [L * E]) nor staged, -1 pads."""
        if not on:
            return
        weight = np.where(in_bank, 0.0, approx)
        weight[self.staged[self.staged >= 0]] = 0.0
        heavy = np.argsort(-weight, kind="stable")[:len(self.chosen)]  # top_k: lower index first
        self.chosen = np.where(weight[heavy] > 0, heavy, -1)


def weight_shares(weights: np.ndarray) -> np.ndarray:
    """serve.weight_shares in numpy: [..., k] float32 -> each pick's share of its token's
    routing weight."""
    w = weights.astype(np.float32)
    total = w.sum(-1, keepdims=True)
    return np.where(total > 0, w / np.where(total > 0, total, 1), 0).astype(np.float32)


def exact_picks(miss: np.ndarray, shares: np.ndarray, threshold: float, budget: int
                ) -> np.ndarray:
    """serve._exact_picks over a step's layers in order (`miss`, `shares` [T, L, k]): the misses
    of at least `threshold` of their token's routing weight, the heaviest first within a layer
    while the step's `budget` of host picks lasts (0: no cap) -> [T, L, k] bool."""
    exact = miss & (shares >= np.float32(threshold))
    if not budget:
        return exact
    used = 0
    for layer in range(miss.shape[1]):
        flat = np.where(exact[:, layer], shares[:, layer], -1.0).reshape(-1)
        rank = np.empty(flat.size, np.int64)
        rank[np.argsort(-flat, kind="stable")] = np.arange(flat.size)
        exact[:, layer] &= (rank < budget - used).reshape(exact[:, layer].shape)
        used += int(exact[:, layer].sum())
    return exact


class HostTierModel:
    """The host cache (HostCache) by rows, without their bytes: `row_at` [capacity] the row each
    host slot holds; boot holds the bank's rows (as the engine boots without a saved history).
    A row read from disk lands by the next step's commit (the engine commits a read that has
    finished by then; a read slower than a step only makes its swap later). `pending`: the rows
    queued (a swap's `request`, a `prefetch`), which the engine counts against PREFETCH_DEPTH
    until the commit that takes them; `landed`: those read in a step (`read_now`: `exact`'s
    misses, `cpu`'s and `auto`'s host picks)."""

    def __init__(self, capacity: int, bank_rows: np.ndarray, n_rows: int):
        held = [int(r) for r in bank_rows if r >= 0]
        self.row_at = np.full(capacity, -1, np.int64)
        self.row_at[:len(held)] = held
        self.held = np.zeros(n_rows, bool)
        self.held[held] = True
        self.pending: set[int] = set()
        self.landed: set[int] = set()
        self.reads = self.prefetches = 0

    def commit(self, demand: np.ndarray, pinned, protect) -> None:
        """The rows read since into host slots (next_batch's commit, place_landed)."""
        landed = [r for r in self.pending | self.landed if not self.held[r]]
        self.pending, self.landed = set(), set()
        for slot, row in place_landed(self.row_at, landed, demand, pinned, protect)[0]:
            if self.row_at[slot] >= 0:
                self.held[self.row_at[slot]] = False
            self.row_at[slot], self.held[row] = row, True

    def read(self, rows) -> int:
        """Queues reads of `rows` neither in host memory nor read or being read (a swap's
        `request`); the reads queued."""
        queued = [r for r in map(int, rows)
                  if not self.held[r] and r not in self.pending and r not in self.landed]
        self.pending.update(queued)
        self.reads += len(queued)
        return len(queued)

    def read_now(self, rows) -> int:
        """`rows` a step reads in its path (`exact`'s misses, the host kernel's picks): each on
        disk lands for the next commit (its queued read, or one read here); the reads started
        here."""
        started = 0
        for row in map(int, rows):
            if self.held[row] or row in self.landed:
                continue
            if row not in self.pending:
                started += 1
            self.pending.discard(row)
            self.landed.add(row)
        self.reads += started
        return started

    def prefetch(self, demand: np.ndarray, pinned, hysteresis: float) -> int:
        """A drain's read ahead (Residency._read_ahead): the engine's own choice of rows
        (hostcache.worth_reading) up to its queue cap (prefetch_room); the reads queued."""
        rows = worth_reading(self.row_at, demand, pinned, hysteresis, self.pending | self.landed)
        queued = self.read(prefetch_room(rows, len(self.pending)))
        self.prefetches += queued
        return queued
