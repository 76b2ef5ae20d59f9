"""The residency state passed into every jitted step: the device bank, its rowmap, the demand
counters, and the host pool of every routed expert.

Bank rows (slots) come in three regions, all one array so the grouped kernel sees one bank:

    [0, resident)                      resident slots: the planner's map (per layer or an arena)
    [resident, resident + ring)        ring slots: recent heavy misses (miss policy "ring"), the
                                       device's own: the steps choose and copy them (swap.py)
    [resident + ring, ... + transient) transient slots: missing rows fetched inside a step ("exact")

The rowmap points at resident or ring slots only; transient slots are scratch, rewritten by every
MoE layer that misses. Pool rows are `moe_layer * E + expert`. Formats, logical axes and the
gate_up layout a tensor split needs: tidejax.contract. Every leaf is placed through
tidejax.parallel: bank and pool by their axes, the map and counters replicated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tidejax import parallel
from tidejax.contract import expert_axes


@struct.dataclass
class Picks:
    """The router's picks of one step, every MoE layer, for routing traces (residency/trace.py):
    ids [rows, L_moe, k] int32 (-1: no token: padding, or rows the step did not fill), weights
    [rows, L_moe, k] float32, resident [rows, L_moe, k] bool (the pick had a bank slot); `at`
    (int32 scalar): the row the next forward's first token takes (a step's prompt chunk, then its
    decoding lanes). Rows past the buffer are dropped."""

    ids: jax.Array
    weights: jax.Array
    resident: jax.Array
    at: jax.Array

    @staticmethod
    def empty(rows: int, n_layers: int, top_k: int) -> "Picks":
        shape = (rows, n_layers, top_k)
        return Picks(jnp.full(shape, -1, jnp.int32), jnp.zeros(shape, jnp.float32),
                     jnp.zeros(shape, bool), jnp.zeros((), jnp.int32))

    def write(self, moe_index: int, ids, weights, resident, live) -> "Picks":
        """One MoE layer's picks of the forward's tokens: ids, weights, resident [T, k], live [T]
        (False: padding, written as id -1)."""
        rows = self.at + jnp.arange(ids.shape[0])
        put = lambda buf, value: buf.at[rows, moe_index].set(value, mode="drop")
        return self.replace(ids=put(self.ids, jnp.where(live[:, None], ids, -1)),
                            weights=put(self.weights, weights.astype(jnp.float32)),
                            resident=put(self.resident, resident))

    def advanced(self, tokens: int) -> "Picks":
        """After a forward of `tokens` tokens: the next one's rows follow."""
        return self.replace(at=self.at + tokens)


@struct.dataclass
class ExpertState:
    bank: dict  # leaves [S_total, ...] on the device
    rowmap: jax.Array  # [L_moe, E] int32: slot (resident or ring) or -1
    slot_rows: jax.Array  # [S_total] int32: pool row held by each slot, or -1 (rowmap's inverse)
    counts: jax.Array  # [L_moe, E] float32: wanted picks since the last drain
    weight_sums: jax.Array  # [L_moe, E] float32: routing weight of those picks
    misses: jax.Array  # [L_moe, E] float32: wanted picks served by a miss in the last step
    approx: jax.Array  # [L_moe, E] float32: those served approximately (substituted), each by
    # its share of its token's routing weight (serve.weight_shares), in the last step
    exact_weight: jax.Array  # float32 scalar: "auto"'s threshold for this step (its SwapBatch's)
    exact_used: jax.Array  # int32 scalar: "auto"'s picks computed on the host so far this step
    ring_hits: jax.Array  # float32 scalar: wanted picks served from ring slots in the last step
    ring_copied: jax.Array  # int32 scalar: rows the last step copied into ring slots
    ring_rows: jax.Array  # [R] int32: pool rows the next step fetches for the ring (-1: none)
    ring_staged_rows: jax.Array  # [R] int32: the pool rows of ring_staged (-1: none)
    ring_next: jax.Array  # int32 scalar: the ring slot (0 .. ring - 1) the next copy takes
    pool: dict | None  # leaves [L_moe * E, ...] (or [host slots, ...] where host_slots maps
    # rows to them: the host cache, residency/hostcache.py), pinned host memory where the backend
    # has it
    ring_staged: dict | None = None  # leaves [R, ...] on the device: rows the last step fetched,
    # which the next writes into ring slots (residency/ring.py)
    host_slots: jax.Array | None = None  # [L_moe * E] int32: each row's pool index, -1 on disk
    # (the host cache's map, set from each SwapBatch); None: the pool holds every row in order
    picks: Picks | None = None  # the step's picks where routing traces are on (residency/trace.py)
    resident: int = struct.field(pytree_node=False, default=0)
    ring: int = struct.field(pytree_node=False, default=0)
    transient: int = struct.field(pytree_node=False, default=0)

    @property
    def n_experts(self) -> int:
        return self.rowmap.shape[1]

    @property
    def n_slots(self) -> int:
        return self.resident + self.ring + self.transient

    @property
    def transient_base(self) -> int:
        return self.resident + self.ring

    @property
    def rows(self) -> dict:
        """The expert rows no step writes: the host pool, or the bank where every expert is
        resident (pool None: nothing swaps). The steps take them beside the donated state, so
        a failed step leaves them whole to rebuild from (Residency.rebuild)."""
        return self.bank if self.pool is None else self.pool

    def without_rows(self) -> "ExpertState":
        return self.replace(bank=None) if self.pool is None else self.replace(pool=None)

    def with_rows(self, rows: dict) -> "ExpertState":
        """The inverse of `without_rows`."""
        return self.replace(bank=rows) if self.bank is None else self.replace(pool=rows)


COUNTERS = ("counts", "weight_sums", "misses", "approx", "exact_weight", "exact_used",
            "ring_hits", "ring_copied", "ring_rows", "ring_staged_rows", "ring_next")


def zero_counters(n_layers: int, n_experts: int, ring_copies: int = 0) -> dict:
    """The counters and the step's tallies, all zero (COUNTERS), and a ring with nothing to copy:
    `ring_copies` rows a step at most."""
    z = jnp.zeros((n_layers, n_experts), jnp.float32)
    return dict(counts=z, weight_sums=z.copy(), misses=z.copy(), approx=z.copy(),
                exact_weight=jnp.zeros((), jnp.float32), exact_used=jnp.zeros((), jnp.int32),
                ring_hits=jnp.zeros((), jnp.float32), ring_copied=jnp.zeros((), jnp.int32),
                ring_rows=jnp.full(ring_copies, -1, jnp.int32),
                ring_staged_rows=jnp.full(ring_copies, -1, jnp.int32),
                ring_next=jnp.zeros((), jnp.int32))


def all_resident_state(pool: dict, n_layers: int) -> ExpertState:
    """Every expert resident: bank = the pool's rows (on the device), rowmap = identity per layer.

    `pool` is a bank-format dict with leaves [n_layers * E, ...]. The state keeps no separate host
    pool (pool=None): nothing can miss, and one buffer must not be donated twice.
    """
    n_rows = jax.tree.leaves(pool)[0].shape[0]
    if n_rows % n_layers:
        raise ValueError(f"expert pool has {n_rows} rows, not a multiple of {n_layers} MoE layers")
    n_experts = n_rows // n_layers
    rowmap = jnp.arange(n_rows, dtype=jnp.int32).reshape(n_layers, n_experts)
    state = ExpertState(bank=pool, rowmap=rowmap, slot_rows=jnp.arange(n_rows, dtype=jnp.int32),
                        pool=None, resident=n_rows, **zero_counters(n_layers, n_experts))
    # committed to the device, as the steps return it: the first step compiles once, not twice
    return _placed(state)


def _placed(state: ExpertState) -> ExpertState:
    """The bank and the ring's staged rows put by their logical axes, the map and counters
    replicated; the pool stays put."""
    names = ("rowmap", "slot_rows") + COUNTERS + (() if state.host_slots is None
                                                  else ("host_slots",))
    maps = parallel.replicated(tuple(getattr(state, name) for name in names))
    staged = state.ring_staged
    return state.replace(bank=parallel.put(state.bank, expert_axes(state.bank)),
                         ring_staged=None if staged is None else parallel.put(
                             staged, expert_axes(staged)),
                         **dict(zip(names, maps)))


def build_state(pool: dict, n_layers: int, slot_rows: np.ndarray, *, ring: int = 0,
                ring_copies: int = 0, transient: int = 0,
                host_slots: np.ndarray | None = None) -> ExpertState:
    """A state whose resident slots hold the pool rows `slot_rows` [resident] (-1 = empty slot);
    `ring` slots of which a step refills up to `ring_copies`.

    `pool` must already be placed (see tidejax.residency.pool.host_pool); the bank is filled from it
    on the device, ring and transient slots start empty (zeros). `host_slots` [L_moe * E]: where
    the pool is a host cache, each row's index in it (-1: on disk); every resident row must be
    there.
    """
    n_rows = jax.tree.leaves(pool)[0].shape[0] if host_slots is None else len(host_slots)
    if n_rows % n_layers:
        raise ValueError(f"expert pool has {n_rows} rows, not a multiple of {n_layers} MoE layers")
    n_experts = n_rows // n_layers
    if not 0 <= ring_copies <= ring:
        raise ValueError(f"ring_copies={ring_copies}: a step copies at most the {ring} ring slots")
    slot_rows = np.asarray(slot_rows, np.int32)
    resident = len(slot_rows)
    held = slot_rows[slot_rows >= 0]
    if len(np.unique(held)) != len(held) or (len(held) and held.max() >= n_rows):
        raise ValueError("slot_rows must name distinct pool rows in [0, L_moe * E)")
    total = resident + ring + transient
    all_rows = np.full(total, -1, np.int32)
    all_rows[:resident] = slot_rows
    rowmap = np.full(n_rows, -1, np.int32)
    rowmap[held] = np.nonzero(slot_rows >= 0)[0]
    at = np.maximum(all_rows, 0)
    if host_slots is not None:
        at = np.asarray(host_slots)[at]
        if (at[all_rows >= 0] < 0).any():
            raise ValueError("a resident row is not in the host cache")
    bank = _fill_bank(pool, jnp.asarray(np.maximum(at, 0)), jnp.asarray(all_rows >= 0))
    staged = (jax.tree.map(lambda leaf: np.zeros((ring_copies,) + leaf.shape[1:], leaf.dtype), pool)
              if ring_copies else None)
    # committed to the device, as the steps return it: the first step compiles once, not twice
    return _placed(ExpertState(bank=bank, rowmap=rowmap.reshape(n_layers, n_experts),
                               slot_rows=all_rows, pool=pool, ring_staged=staged,
                               host_slots=None if host_slots is None else np.asarray(
                                   host_slots, np.int32),
                               resident=resident, ring=ring,
                               transient=transient,
                               **zero_counters(n_layers, n_experts, ring_copies)))


def fetch_row(pool: dict, row) -> dict:
    """One pool row (a traced int) as device arrays: a data-dependent read of host memory."""
    return jax.tree.map(
        lambda leaf: parallel.to_device(jax.lax.dynamic_index_in_dim(leaf, row, keepdims=False)),
        pool)


def read_row(state: ExpertState, row, disk=None) -> dict:
    """Pool row `row` (a traced int) as device arrays: through the host cache's map where there
    is one; a row on disk is read by `disk` (hostcache.HostCache.fetch: a host callback that
    waits for the read), which the caller gives where such a row can be asked for."""
    if state.host_slots is None:
        return fetch_row(state.pool, row)
    at = state.host_slots[row]
    if disk is None:
        return fetch_row(state.pool, jnp.maximum(at, 0))
    return jax.lax.cond(at >= 0, lambda: fetch_row(state.pool, jnp.maximum(at, 0)),
                        lambda: jax.tree.map(parallel.to_device, disk.fetch(row)))


def write_row(bank: dict, slot, row: dict) -> dict:
    """bank[slot] = row, in place when the bank is donated."""
    return jax.tree.map(lambda b, r: jax.lax.dynamic_update_index_in_dim(b, r.astype(b.dtype), slot, 0),
                        bank, row)


@jax.jit
def _fill_bank(pool, rows, filled):
    """A fresh device bank [len(rows), ...] filled row by row from the pool; empty slots are zeros.

    Row by row, so host memory is only ever read one row at a time (as in a swap).
    """
    bank = jax.tree.map(lambda leaf: jnp.zeros((rows.shape[0],) + leaf.shape[1:], leaf.dtype), pool)

    def body(slot, bank):
        return jax.lax.cond(filled[slot], lambda b: write_row(b, slot, fetch_row(pool, rows[slot])),
                            lambda b: b, bank)

    return jax.lax.fori_loop(0, rows.shape[0], body, bank)
