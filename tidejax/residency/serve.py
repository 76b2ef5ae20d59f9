"""Routed experts of one MoE layer through the residency bank: map wanted experts to slots, serve
the misses by the chosen policy, run the grouped kernel, which also counts the demand.

Miss policies (DESIGN.md "Miss policies"):
- "exact": the missing experts' rows are fetched from the host pool into the bank's transient
  slots inside the step; the output equals all-resident.
- "substitute": a missing pick goes to the token's best-scoring resident expert it has not picked
  yet (with the wanted pick's routing weight); no host read.
- "ring": inside the step as "substitute"; the step's heaviest misses by routing weight are
  copied into ring slots by the next step, overlapped with its compute (residency/ring.py), and
  routable from the step after.
- "cpu": the missed picks are computed on the host CPU from the host pool (tidejax.residency.cpu,
  one callback a layer) while the device computes the resident ones; the two parts are summed
  in float32; the output equals all-resident within float32 rounding (the bound: cpu.py). Over
  the disk tier a layer with a missed pick of a row on disk waits for its read (cpu.py).
- "auto": by weight. A missed pick carrying at least the step's `exact_weight` of its token's
  routing weight (weight_shares) is computed on the host as under "cpu", the heaviest first while
  the step's `exact_budget` of such picks lasts (the layers in order); the other misses are
  substituted as under "substitute".
Demand counters always record the *wanted* picks, resident or not; the step tallies its misses
and, for the picks it substituted, their routing weight shares (`ExpertState.approx`); where
routing traces are on, the picks themselves go into `ExpertState.picks`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tidejax import ops, parallel
from tidejax.config import MISS_POLICIES
from tidejax.contract import expert_axes
from tidejax.residency.cpu import CpuExperts
from tidejax.residency.hostcache import HostCache
from tidejax.residency.state import ExpertState, read_row, write_row


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """Static (hashable) choices for serve_routed; part of the jitted step's cache key."""

    miss_policy: str = "exact"
    kernel: str = "auto"  # the ops' implementation in a forward served with these (ops.kernels)
    moe_prefill: str = ops.dispatch.MOE_PREFILL  # a prompt chunk's grouped kernel (moe_grouped)
    mhc_front: str = ops.dispatch.MHC_FRONT  # an mHC site's front half (ops.mhc_front)
    scan_layers: bool = False  # run a model's runs of like layers as one scanned body (V4.1)
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0  # the activation's variant (tidejax.contract.swiglu): gpt-oss
    swiglu_up_shift: float = 0.0
    count: bool = True  # demand counters and miss tallies on (off only to measure their cost)
    all_resident: bool = False  # every expert has a slot: skip the miss machinery
    cpu: CpuExperts | None = None  # the host pool "cpu" and "auto" compute misses from
    disk: HostCache | None = None  # "exact": where the host pool is a cache, misses on disk
    exact_budget: int = 0  # "auto": picks computed on the host a step at most (0: no cap)

    def __post_init__(self):
        if self.miss_policy not in MISS_POLICIES:
            raise ValueError(f"miss_policy={self.miss_policy!r}, expected one of {MISS_POLICIES}")
        if self.kernel not in ops.IMPLS:
            raise ValueError(f"kernel={self.kernel!r}, expected one of {ops.IMPLS}")
        if self.moe_prefill not in ops.MOE_PREFILL_KERNELS:
            raise ValueError(f"moe_prefill={self.moe_prefill!r}, expected one of "
                             f"{ops.MOE_PREFILL_KERNELS}")
        if self.mhc_front not in ops.MHC_FRONTS:
            raise ValueError(f"mhc_front={self.mhc_front!r}, expected one of {ops.MHC_FRONTS}")
        if self.exact_budget < 0 or (self.exact_budget and self.miss_policy != "auto"):
            raise ValueError(f"exact_budget={self.exact_budget}: a cap of miss policy 'auto' "
                             "(at least 0)")


def serve_routed(moe_index: int, x, ids, weights, choice_scores, token_mask, state: ExpertState,
                 options: ServeOptions):
    """x [T, D]; ids / weights [T, k] the router's wanted picks; choice_scores [T, E] (higher =
    preferred); token_mask [T] bool (False = padding, computes nothing) -> (y [T, D], state).
    moe_index: an int, or an int32 scalar (a scanned layer's) but under "cpu" and "auto"."""
    layer_map = state.rowmap[moe_index]  # [E]
    slots = layer_map[ids]  # [T, k]
    live = token_mask[:, None]  # [T, 1]
    if state.picks is not None:  # routing traces (residency/trace.py)
        state = state.replace(picks=state.picks.write(moe_index, ids, weights, slots >= 0,
                                                      token_mask))
    host = None  # [T, D] float32: the picks computed on the host ("cpu", "auto")
    if not options.all_resident:
        policy = options.miss_policy
        miss = live & (slots < 0)  # [T, k]
        shares = weight_shares(weights)  # [T, k]
        approx = None  # [T, k]: the misses served approximately (substituted)
        if policy == "exact":
            slots, state = _fetch_misses(moe_index, ids, miss, slots, state, options.disk)
        elif policy in ("cpu", "auto"):  # the host's slots stay -1: skipped on the device
            if options.swiglu_alpha != 1.0 or options.swiglu_up_shift:
                raise ValueError(f"miss policy {policy!r}: the host kernel computes only "
                                 "silu(g) * u (this family's experts use another activation)")
            if options.cpu is None:
                raise ValueError(f"miss policy {policy!r} needs the host experts "
                                 "(ServeOptions.cpu)")
            on_host = miss
            if policy == "auto":
                on_host, state = _exact_picks(miss, shares, state, options.exact_budget)
                approx = miss & ~on_host
                slots = _substitute(ids, approx, slots, choice_scores, layer_map)
            host = options.cpu.serve(moe_index, x, ids, weights, on_host, options.swiglu_limit,
                                     state.host_slots)
        else:
            approx = miss
            slots = _substitute(ids, miss, slots, choice_scores, layer_map)
        if options.count or policy == "ring":  # the step's tallies
            if policy == "ring":
                ring = ~miss & live & (slots >= state.resident) & (slots < state.transient_base)
                state = state.replace(ring_hits=state.ring_hits + ring.sum(dtype=jnp.float32))
            state = state.replace(misses=state.misses.at[moe_index, ids].add(miss.astype(jnp.float32)))
            if approx is not None:
                state = state.replace(approx=state.approx.at[moe_index, ids].add(
                    jnp.where(approx, shares, 0.0)))
    bank = state.bank
    if options.all_resident and jax.default_backend() != "gpu":
        # The reference scans every slot; under the identity map this layer's experts are one
        # contiguous block, so scan only those (the GPU kernel reads just the picked slots).
        e = state.n_experts
        bank = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, moe_index * e, e), bank)
        slots = slots - moe_index * e
    slots = jnp.where(live, slots, -1)
    # beside host picks the resident part stays float32 until the two are summed
    y, counts = _grouped(moe_index, x if host is None else x.astype(jnp.float32), bank, slots,
                         ids, weights, token_mask, state, options)
    if host is not None:
        y = (y + host).astype(x.dtype)
    if counts is None:
        return y, state
    return y, state.replace(counts=counts[0], weight_sums=counts[1])


def _grouped(moe_index: int, x, bank, slots, ids, weights, token_mask, state: ExpertState,
             options: ServeOptions):
    """The grouped kernel over the bank, counting the wanted picks where options.count: (y [T, D],
    (counts, weight_sums) or None). Where the mesh splits "tensor" it runs on each device's
    slice of every expert's intermediate (parallel.over_tensor), its y summed over the devices;
    the counts are of the same picks everywhere."""
    counters = (state.counts, state.weight_sums) if options.count else None

    def local(x, bank, slots, ids, weights, token_mask, counters):
        demand = None if counters is None else ops.Demand(*counters, moe_index, ids, weights,
                                                          token_mask)
        with ops.kernels(options.kernel):  # as a forward served with these options runs it
            out = ops.moe_grouped(x, bank, slots, weights, swiglu_limit=options.swiglu_limit,
                                  swiglu_alpha=options.swiglu_alpha,
                                  swiglu_up_shift=options.swiglu_up_shift, demand=demand,
                                  prefill=options.moe_prefill, n_experts=state.n_experts)
        return (out, None) if demand is None else (out[0], out[1:])

    return parallel.over_tensor(local, (None, expert_axes(bank)) + (None,) * 5, ("sum", None))(
        x, bank, slots, ids, weights, token_mask, counters)


def weight_shares(weights):
    """weights [T, k] -> [T, k] float32: each pick's share of its token's routing weight, the
    router's weight over the sum of the token's k weights. "auto"'s exact_weight and the
    approximate share are in these units for every family: DeepSeek-V3 / V4 / V4.1 normalize
    their top-k weights (norm_topk_prob) and then scale them (routed_scaling_factor), which the
    share undoes; DeepSeek-V2's softmax without norm_topk_prob gives top-k probabilities that sum
    below 1, and the share is each one's part of that sum."""
    w = weights.astype(jnp.float32)
    total = w.sum(-1, keepdims=True)
    return jnp.where(total > 0, w / jnp.where(total > 0, total, 1.0), 0.0)


def _exact_picks(miss, shares, state: ExpertState, budget: int):
    """"auto": the misses carrying at least the step's exact_weight of their token's routing
    weight, the heaviest first while the step's budget of host picks lasts (0: no cap) ->
    ([T, k] bool, state with the step's exact_used counted)."""
    exact = miss & (shares >= state.exact_weight)
    if budget:
        flat = jnp.where(exact, shares, -1.0).reshape(-1)
        order = jnp.argsort(-flat, stable=True)  # heaviest first
        rank = jnp.zeros(flat.shape, jnp.int32).at[order].set(
            jnp.arange(flat.size, dtype=jnp.int32))
        exact = exact & (rank < budget - state.exact_used).reshape(exact.shape)
        state = state.replace(exact_used=state.exact_used + exact.sum(dtype=jnp.int32))
    return exact, state


def _fetch_misses(moe_index: int, ids, miss, slots, state: ExpertState, disk=None):
    """Copies each distinct missing expert's pool row into a transient slot (a row on disk
    read by `disk`, waiting: state.read_row); returns the slots."""
    t, k = ids.shape
    n_experts = state.n_experts
    most = min(t * k, n_experts)  # distinct misses possible in this layer
    if state.transient < most:
        raise ValueError(f"miss policy 'exact' with {t} tokens x top-{k} needs {most} transient "
                         f"slots in the bank; the state has {state.transient}")
    if state.pool is None:
        raise ValueError("miss policy 'exact' needs the host pool (this state has none)")
    need = jnp.zeros(n_experts, bool).at[ids].max(miss)  # [E]
    rank = jnp.cumsum(need) - 1  # [E]: transient index of each missing expert
    order = jnp.nonzero(need, size=most, fill_value=0)[0]  # [most]: the missing experts, in order
    base = state.transient_base

    def fetch(i, bank):
        return write_row(bank, base + i, read_row(state, moe_index * n_experts + order[i], disk))

    bank = jax.lax.fori_loop(0, need.sum(), fetch, state.bank)
    slots = jnp.where(miss, base + rank[ids], slots).astype(jnp.int32)
    return slots, state.replace(bank=bank)


def _substitute(ids, miss, slots, choice_scores, layer_map):
    """The i-th missing pick of a token takes the token's i-th best resident expert among those it
    did not pick; -1 (skip) when the layer has no such expert."""
    t, k = ids.shape
    picked = jnp.zeros(choice_scores.shape, bool).at[jnp.arange(t)[:, None], ids].set(~miss)
    allowed = (layer_map >= 0)[None, :] & ~picked  # [T, E]
    finite = jnp.where(jnp.isfinite(choice_scores), choice_scores, -1e30)
    score = jnp.where(allowed, finite.astype(jnp.float32), -jnp.inf)
    best_score, best = jax.lax.top_k(score, k)  # [T, k]
    nth = jnp.maximum(jnp.cumsum(miss, axis=1) - 1, 0)  # [T, k]
    sub = jnp.take_along_axis(best, nth, axis=1)
    ok = jnp.take_along_axis(best_score, nth, axis=1) > -jnp.inf
    return jnp.where(miss, jnp.where(ok, layer_map[sub], -1), slots).astype(jnp.int32)
