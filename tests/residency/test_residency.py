"""Residency on a toy MoE stack: miss policies, counters, swaps (in place, lossless, stale)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.residency_fixtures import D, E, K, L, make_pool, make_router, tokens, toy_step
from tidejax.pallas.moe import moe_grouped_reference
from tidejax.residency.planner import place
from tidejax.residency.pool import host_pool
from tidejax.residency.serve import ServeOptions, serve_routed
from tidejax.residency.state import all_resident_state, build_state
from tidejax.residency.swap import SwapBatch, apply_now

REF = dict(kernel="reference")
NO_BIAS = jnp.zeros(E, jnp.float32)


def half_state(pool_np, geometry="per_layer", transient=E, ring=0, seed=0, ring_copies=0):
    """Half the experts resident, chosen at random (per layer or across the arena)."""
    r = np.random.default_rng(seed)
    rows = r.permutation(L * E) if geometry == "arena" else np.concatenate(
        [layer * E + r.permutation(E) for layer in range(L)])
    slot_rows = place(rows, L * E // 2, L, E, geometry)
    return build_state(host_pool(pool_np), L, slot_rows, ring=ring, ring_copies=ring_copies,
                       transient=transient)


def run(state, x, options, bias=NO_BIAS, mask=None):
    mask = jnp.ones(x.shape[0], bool) if mask is None else mask
    return toy_step(state, x, mask, jnp.asarray(make_router()), bias, options)


@pytest.mark.parametrize("fmt,geometry", [("dense", "per_layer"), ("dense", "arena"),
                                          ("mxfp4", "per_layer")])
def test_exact_with_half_resident_equals_all_resident(fmt, geometry):
    pool = make_pool(fmt)
    full = all_resident_state(pool, L)
    half = half_state(pool, geometry)
    for seed in range(3):
        x = tokens(seed)
        want, full = run(full, x, ServeOptions(all_resident=True, **REF))
        got, half = run(half, x, ServeOptions(miss_policy="exact", **REF))
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert float(half.misses.sum()) > 0  # the comparison really exercised misses


def test_exact_needs_enough_transient_slots():
    pool = make_pool()
    with pytest.raises(ValueError, match="transient slots"):
        run(half_state(pool, transient=2), tokens(0), ServeOptions(**REF))


def _substitutes(ids, miss, choice, resident):
    """numpy: the i-th missing pick takes the i-th best resident expert the token did not pick."""
    out = ids.copy()
    for t in range(ids.shape[0]):
        kept = set(ids[t][~miss[t]].tolist())
        cands = [e for e in np.argsort(-choice[t], kind="stable") if resident[e] and e not in kept]
        for n, j in enumerate(np.nonzero(miss[t])[0]):
            out[t, j] = cands[n] if n < len(cands) else -1
    return out


def test_substitute_serves_only_resident_experts():
    pool = make_pool()
    state = half_state(pool, transient=0)
    r = np.random.default_rng(3)
    # non-resident rows of the host pool are NaN: reading any of them would poison the output
    resident_rows = np.asarray(state.slot_rows)[np.asarray(state.slot_rows) >= 0]
    poisoned = {k: v.copy() for k, v in pool.items()}
    for v in poisoned.values():
        v[np.setdiff1d(np.arange(L * E), resident_rows)] = np.nan
    state = state.replace(pool=host_pool(poisoned))
    t = 6
    x = jnp.asarray(r.standard_normal((t, D)), jnp.float32)
    choice = r.standard_normal((t, E)).astype(np.float32)
    ids = np.argsort(-choice, axis=1)[:, :K].astype(np.int32)
    weights = r.random((t, K)).astype(np.float32)
    mask = np.array([1, 1, 1, 1, 1, 0], bool)
    options = ServeOptions(miss_policy="substitute", **REF)
    layer = 1
    y, state = jax.jit(serve_routed, static_argnums=(0, 7))(
        layer, x, jnp.asarray(ids), jnp.asarray(weights), jnp.asarray(choice), jnp.asarray(mask),
        state, options)
    assert np.isfinite(np.asarray(y)).all()
    rowmap = np.asarray(state.rowmap[layer])
    miss = rowmap[ids] < 0
    assert miss[mask].any()
    sub = _substitutes(ids, miss, choice, rowmap >= 0)
    assert (rowmap[sub[sub >= 0]] >= 0).all()
    # the same picks computed over the all-resident bank (true pool, expert ids as slots)
    dense = {k: jnp.asarray(v[layer * E:(layer + 1) * E]) for k, v in pool.items()}
    want = moe_grouped_reference(x, dense, jnp.asarray(np.where(mask[:, None], sub, -1)),
                                 jnp.asarray(weights))
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6, atol=1e-6)
    # demand counted the wanted picks, misses the non-resident ones, padding neither
    np.testing.assert_array_equal(np.asarray(state.counts[layer]),
                                  np.bincount(ids[mask].ravel(), minlength=E))
    np.testing.assert_array_equal(np.asarray(state.misses[layer]),
                                  np.bincount(ids[mask][miss[mask]], minlength=E))


@pytest.mark.parametrize("policy", ["exact", "substitute", "ring"])
def test_counters_equal_bincount_of_wanted_picks(policy):
    pool = make_pool()
    state = half_state(pool, ring=2 if policy == "ring" else 0,
                       transient=E if policy == "exact" else 0)
    r = np.random.default_rng(5)
    options = ServeOptions(miss_policy=policy, **REF)
    serve = jax.jit(serve_routed, static_argnums=(0, 7), donate_argnums=6)
    want_counts, want_weights = np.zeros((L, E)), np.zeros((L, E))
    for step in range(4):
        t = 5
        layer = step % L
        ids = np.stack([r.choice(E, K, replace=False) for _ in range(t)]).astype(np.int32)
        weights = r.random((t, K)).astype(np.float32)
        mask = r.random(t) < 0.7
        _, state = serve(layer, jnp.asarray(r.standard_normal((t, D)), jnp.float32),
                         jnp.asarray(ids), jnp.asarray(weights),
                         jnp.asarray(r.standard_normal((t, E)), jnp.float32), jnp.asarray(mask),
                         state, options)
        want_counts[layer] += np.bincount(ids[mask].ravel(), minlength=E)
        want_weights[layer] += np.bincount(ids[mask].ravel(), weights[mask].ravel(), minlength=E)
    np.testing.assert_array_equal(np.asarray(state.counts), want_counts)
    np.testing.assert_allclose(np.asarray(state.weight_sums), want_weights, rtol=1e-6)


def test_counting_off_leaves_counters_alone():
    state = half_state(make_pool())
    _, state = run(state, tokens(0), ServeOptions(count=False, **REF))
    assert float(state.counts.sum()) == 0 and float(state.misses.sum()) == 0


@pytest.mark.parametrize("ring", [0, 2])
def test_swap_is_in_place(ring):
    """Swaps and ring copies write the donated bank in place: temporaries of a few rows (the
    ring's fetched rows among them), never a copy of the bank."""
    state = half_state(make_pool("mxfp4"), ring=ring, ring_copies=ring)
    bank_bytes = sum(a.nbytes for a in jax.tree.leaves(state.bank))
    row_bytes = bank_bytes // state.n_slots
    lowered = apply_now.lower(state, SwapBatch(np.zeros(8, np.int32), np.arange(8, dtype=np.int32),
                                               np.int32(3), np.bool_(False), np.float32(0.2),
                                               np.bool_(True)))
    mem = lowered.compile().memory_analysis()
    assert mem.alias_size_in_bytes >= bank_bytes
    assert mem.temp_size_in_bytes <= (4 + 2 * ring) * row_bytes + 4096


def test_swap_campaign_then_restore_is_lossless():
    pool = make_pool("mxfp4")
    state = half_state(pool, ring=2)
    boot_rows = np.asarray(state.slot_rows).copy()
    boot_bank = jax.tree.map(np.asarray, state.bank)
    x = tokens(11)
    options = ServeOptions(miss_policy="substitute", **REF)
    before, state = run(state, x, options)
    r = np.random.default_rng(0)
    n_slots = state.resident + state.ring
    for batch in range(1250):  # 10,000 swaps, 8 a call
        pairs = zip(r.integers(0, n_slots, 8).tolist(), r.integers(0, L * E, 8).tolist())
        state, _ = apply_now(state, SwapBatch.of(list(pairs), 8))
    assert not np.array_equal(np.asarray(state.slot_rows), boot_rows)
    _check_map(state)
    for slot in range(n_slots):  # restore the boot map, slot by slot (ring slots empty)
        state, _ = apply_now(state, SwapBatch.of([(slot, int(boot_rows[slot]))], 8))
    np.testing.assert_array_equal(np.asarray(state.slot_rows), boot_rows)
    after, state = run(state, x, options)
    np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    for got, want in zip(jax.tree.leaves(state.bank), jax.tree.leaves(boot_bank)):
        np.testing.assert_array_equal(np.asarray(got)[:state.resident], want[:state.resident])


def _check_map(state):
    """rowmap and its inverse agree; every occupied slot holds its row's pool bytes."""
    slot_rows = np.asarray(state.slot_rows)
    rowmap = np.asarray(state.rowmap).reshape(-1)
    for slot, row in enumerate(slot_rows):
        if row >= 0:
            assert rowmap[row] == slot
    held = np.nonzero(rowmap >= 0)[0]
    assert (slot_rows[rowmap[held]] == held).all()
    assert len(np.unique(slot_rows[slot_rows >= 0])) == (slot_rows >= 0).sum()
    bank = jax.tree.map(np.asarray, state.bank)
    pool = jax.tree.map(np.asarray, state.pool)
    for slot in np.nonzero(slot_rows >= 0)[0]:
        for name in bank:
            np.testing.assert_array_equal(bank[name][slot], pool[name][slot_rows[slot]])
