"""The `ring` policy's copies (residency/ring.py): chosen on the device by routing weight, fetched
by the next step beside its layers, routable in the step after, and lossless."""

import re

import jax.numpy as jnp
import numpy as np

import tidejax
from tests.support.residency_fixtures import E, L, make_pool, make_router, tokens, toy_batch_step
from tidejax.residency import seedmap
from tidejax.residency.pool import host_pool
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import build_state
from tidejax.residency.swap import SwapBatch, apply_now

HOT = [4, 5, 6, 7]  # the experts the router bias favours in every layer: every pick is one
BIAS = jnp.asarray(np.where(np.isin(np.arange(E), HOT), 30.0, 0.0), jnp.float32)
ROUTER = jnp.asarray(make_router())
MASK = jnp.ones(4, bool)
RING = SwapBatch.of([], 0, ring=True)
ENGINE = {"lanes": 2, "max_context": 96, "page_size": 8}
PROMPT = np.random.RandomState(4).randint(3, 256, 12).tolist()


def step(state, policy, x, batch=RING):
    options = ServeOptions(miss_policy=policy, kernel="reference")
    return toy_batch_step(state, batch, x, MASK, ROUTER, BIAS, options)


def resident_without(pool, out, **kw):
    """Per layer the four HOT experts resident but the rows `out`, whose slots hold cold ones."""
    slot_rows = []
    for layer in range(L):
        rows = [layer * E + e for e in HOT]
        spare = iter(layer * E + e for e in range(E) if e not in HOT)
        slot_rows += [next(spare) if r in out else r for r in rows]
    return build_state(host_pool(pool), L, np.asarray(slot_rows), **kw)


def test_a_copy_issued_in_one_step_is_routable_in_the_next():
    """Two picked experts are not resident. Step A fetches them (the ring's rows, as a step's
    end leaves them) and substitutes their picks; step B writes them into ring slots at its start
    and routes to them: ring hits and no misses (the engine test below compares with `exact`)."""
    pool = make_pool()
    x = tokens(0)
    out = [0 * E + HOT[0], 2 * E + HOT[1]]
    ring = resident_without(pool, out, ring=2, ring_copies=2)
    ring = ring.replace(ring_rows=jnp.asarray(out, jnp.int32))
    got_a, ring, tally_a = step(ring, "ring", x)
    assert float(tally_a.misses.sum()) > 0 and int(tally_a.ring_copies) == 0
    assert float(tally_a.ring_hits) == 0
    assert (np.asarray(ring.ring_rows) == -1).all()  # its misses are staged, not chosen again
    got_b, ring, tally_b = step(ring, "ring", x)
    assert int(tally_b.ring_copies) == 2 and float(tally_b.ring_hits) > 0
    assert float(tally_b.misses.sum()) == 0
    assert not np.array_equal(np.asarray(got_a), np.asarray(got_b))  # A substituted
    rowmap = np.asarray(ring.rowmap).reshape(-1)
    for row in out:
        slot = rowmap[row]
        assert ring.resident <= slot < ring.resident + ring.ring
        np.testing.assert_array_equal(np.asarray(ring.bank["down"][slot]), pool["down"][row])


def test_the_ring_takes_the_heaviest_misses_by_routing_weight():
    """The rows chosen for the next step follow the misses' routing weight, not their count, and
    skip rows already in the bank or staged; a frozen batch leaves the choice alone."""
    pool = make_pool()
    state = resident_without(pool, [], ring=4, ring_copies=2)
    resident = int(np.asarray(state.slot_rows)[0])
    staged = 1 * E + 1
    misses = np.zeros((L, E), np.float32)
    approx = np.zeros((L, E), np.float32)
    misses[0, 0], approx[0, 0] = 9.0, 0.1  # many light misses
    misses[0, 1], approx[0, 1] = 1.0, 0.9  # one heavy miss
    misses[2, 3], approx[2, 3] = 2.0, 0.5
    approx.reshape(-1)[resident] = approx.reshape(-1)[staged] = 5.0
    pending = [2 * E, -1]  # chosen by an earlier step
    state = state.replace(misses=jnp.asarray(misses), approx=jnp.asarray(approx),
                          ring_rows=jnp.asarray(pending, jnp.int32),
                          ring_staged_rows=jnp.asarray([staged, -1], jnp.int32))
    frozen, tally = apply_now(state, SwapBatch.of([], 0))
    np.testing.assert_array_equal(np.asarray(frozen.ring_rows), pending)
    np.testing.assert_array_equal(np.asarray(frozen.ring_staged_rows), [staged, -1])
    assert int(tally.ring_copies) == 0
    state, tally = apply_now(frozen.replace(misses=jnp.asarray(misses),
                                            approx=jnp.asarray(approx)), RING)
    assert int(tally.ring_copies) == 1  # the staged row, now in a ring slot
    np.testing.assert_array_equal(np.asarray(state.ring_staged_rows), pending)
    np.testing.assert_array_equal(np.asarray(state.ring_rows), [0 * E + 1, 2 * E + 3])


def _entry(hlo: str) -> dict[str, set[str]]:
    """The ENTRY computation of an HLO module: instruction -> the instructions it reads or
    follows (operands and control predecessors)."""
    body = hlo[hlo.index("\nENTRY"):]
    body = body[body.index("{") + 1:body.index("\n}")]
    graph = {}
    for line in body.strip().splitlines():
        name, rhs = line.strip().removeprefix("ROOT ").split(" = ", 1)
        rhs = re.sub(r"(calls|to_apply|called_computations|condition|body)=[{%][^,}]*}?", "", rhs)
        graph[name] = set(re.findall(r"%[\w.\-]+", rhs))
    return graph


def _closure(graph, start, edges) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        for n in edges(todo.pop()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_the_ring_fetch_has_no_dependency_on_the_layers_either_way():
    """In the compiled step (CPU), the ring's reads of the host pool depend on no layer's
    compute, and the step's output reads nothing they fetched: the copy can run beside the
    layers (on the GPU an asynchronous host-to-device copy)."""
    state = resident_without(make_pool(), [], ring=2, ring_copies=2)
    options = ServeOptions(miss_policy="ring", kernel="reference")
    hlo = toy_batch_step.lower(state, RING, tokens(0), MASK, ROUTER, BIAS,
                               options).compile().as_text()
    graph = _entry(hlo)
    params = {n for n in graph if re.search(r"\bparameter\(", hlo.split(f"{n} = ", 1)[1]
                                            .split("\n", 1)[0])}
    pool = {n for n in params if n.startswith("%state_pool")}
    x = {n for n in params if n.startswith("%x")}
    assert len(pool) == len(state.pool) and len(x) == 1
    root = next(line for line in hlo[hlo.index("\nENTRY"):].splitlines() if "ROOT" in line)
    root_name = root.split()[1]
    fetch = {n for n, ins in graph.items() if ins & pool and n != root_name}
    assert fetch  # the ring's fetch (the step has no swap loop: its batch is empty)
    users = {}
    for n, ins in graph.items():
        for i in ins:
            users.setdefault(i, set()).add(n)
    layers = _closure(graph, x, lambda n: users.get(n, ()))  # everything x reaches
    for f in fetch:
        assert not _closure(graph, [f], lambda n: graph.get(n, ())) & (layers | x), f
    y = re.findall(r"%[\w.\-]+", root.split("tuple(", 1)[1])[0]  # the step's output x
    assert not _closure(graph, [y], lambda n: graph.get(n, ())) & fetch


def test_the_engine_scores_as_exact_once_the_ring_holds_its_misses(tiny_checkpoint, tmp_path):
    """Through the engine's own steps (scoring): half the experts resident and a ring for all
    the others. The first forward substitutes its misses, the next fetches them, and the one
    after routes to them from ring slots: no miss, and the logits and greedy tokens of `exact`."""
    model_dir = tiny_checkpoint("deepseek_v3", "qlora_groups", seed=5)
    seed = tmp_path / "seed.json"  # 2 MoE layers of 8 experts: the first 4 of each resident
    seedmap.write({"format": seedmap.FORMAT, "geometry": "per_layer", "n_layers": 2,
                   "n_experts": 8, "budget": 8, "rows": [0, 1, 2, 3, 8, 9, 10, 11]}, seed)
    residency = {"budget_experts": 8, "drain_every": 1000, "seed_map": str(seed)}
    exact = tidejax.load(model_dir, engine=ENGINE, residency={**residency, "miss_policy": "exact"})
    ring = tidejax.load(model_dir, engine=ENGINE, residency={**residency, "miss_policy": "ring",
                                                             "ring_slots": 8})
    res = ring.residency
    assert res.n_layers * res.n_experts - res.n_resident == 8 == res.ring_per_step
    want = exact.logits(PROMPT)
    first = ring.logits(PROMPT)
    assert res.stats()["misses"] > 0 and not np.allclose(first, want, atol=1e-5)
    ring.logits(PROMPT)
    misses = res.stats()["misses"]
    got = ring.logits(PROMPT)
    assert res.stats()["misses"] == misses and res.stats()["ring_hits"] > 0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
