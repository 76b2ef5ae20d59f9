"""One decode state, one owner: the DecodeState is donated into every step, residency's swap
batches are applied inside the step that takes them, lane sampling lives in the state, and the
scheduler thread is the only caller of the steps (`Engine.logits` while serving goes through it
without disturbing a decoding request)."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

import tidejax
from tidejax.residency import manager
from tidejax.residency.swap import SwapBatch
from tidejax.runtime.sampling import SamplingParams
from tidejax.runtime.scheduler import DoneEvent, GenerationRequest, TokenEvent
from tidejax.runtime.steps import DecodeRows

ENGINE = {"lanes": 2, "max_context": 96, "page_size": 8}
PROMPT = np.random.RandomState(4).randint(3, 256, 12).tolist()


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v3", "qlora_groups", seed=5)


HALF_EXACT = {"budget_experts": 8, "miss_policy": "exact"}


@pytest.fixture(scope="module")
def resident(model_dir):
    return tidejax.load(model_dir, engine=ENGINE)


@pytest.fixture(scope="module")
def half(model_dir):
    """Half the experts resident, misses fetched exactly, a drain and plan every 3 steps, at
    most 2 swaps a step: one engine for the tests that do not need their own residency."""
    return tidejax.load(model_dir, engine=ENGINE, residency={
        **HALF_EXACT, "drain_every": 3, "half_life": 4.0, "max_swaps_per_step": 2})


def decode_rows(engine, positions) -> DecodeRows:
    """A decode step's rows, each lane's pages held by a sequence id no request has (requests
    count up from 0, and how many ran before depends on which tests ran first in the process)."""
    lanes = engine.lanes
    pages = engine.scheduler.pages
    held = [pages.grow(-1 - lane, int(positions[lane]) + 1) for lane in range(lanes)]
    return DecodeRows(np.full(lanes, 7, np.int32), np.ones(lanes, bool),
                      np.asarray(positions, np.int32), np.ones(lanes, bool), held)


def test_the_step_applies_the_planned_swaps_and_no_other_call_does(half, monkeypatch):
    engine = half
    res = engine.residency
    boot = np.asarray(engine.state.experts.slot_rows).copy()
    # every layer wants its cold experts: the drain's plan queues swaps for the next steps
    cold = ~np.isin(np.arange(res.n_layers * res.n_experts), boot[:res.n_resident])
    res.history.weights[:] = np.where(cold, 50.0, 0.0).reshape(res.history.shape)  # the demand
    engine.runner.update_experts(res.drain)
    assert 2 < res.stats()["swaps_queued"] <= 4
    applied = res.stats()["swaps_applied"]  # by the calibration's reseed, between steps
    between_steps = []
    monkeypatch.setattr(manager, "apply_now",
                        lambda *a: between_steps.append(1) or pytest.fail("a separate swap call"))
    engine.step(decode_rows(engine, [3, 5]), None)
    after = np.asarray(engine.state.experts.slot_rows)
    assert res.stats()["swaps_applied"] - applied == 2 and not between_steps
    assert (after != boot).sum() == 2  # the step's output state holds the new map
    np.testing.assert_array_equal(after, res.slot_rows)
    rowmap = np.asarray(engine.state.experts.rowmap).reshape(-1)
    for slot, row in enumerate(after[:res.n_resident]):
        assert rowmap[row] == slot
    compiled = engine.loaded.steps.step.jitted._cache_size()
    engine.step(decode_rows(engine, [4, 6]), None)  # the rest of the queue, same compilation
    np.testing.assert_array_equal(np.asarray(engine.state.experts.slot_rows), res.slot_rows)
    assert res.stats()["swaps_queued"] == 0
    assert engine.loaded.steps.step.jitted._cache_size() == compiled


def test_the_swap_batch_is_written_in_place_inside_the_step(half):
    """The lowered step takes the swap batch and aliases the whole state (bank included): the
    rows are written into the donated bank, not into a copy."""
    engine = half
    inputs = engine.loaded.step_inputs(decode_rows(engine, [3, 5]), None, None,
                                       SwapBatch.of([], engine.residency.batch_length))
    lowered = engine.runner.lower(inputs)
    assert "while" in lowered.as_text()  # the batch's loop over its swaps
    memory = lowered.compile().memory_analysis()
    bank = sum(leaf.nbytes for leaf in jax.tree.leaves(engine.state.experts.bank))
    assert memory.alias_size_in_bytes >= bank


def test_a_step_without_swaps_has_no_swap_loop(model_dir, half):
    """Residency hands a step with nothing to swap a batch of length 0, so that step compiles
    without the loop (whose dynamic trip count the GPU's host would wait to read); one with swaps
    gets it. Substitute misses add no loop of their own."""
    engine = tidejax.load(model_dir, engine=ENGINE, residency={
        **HALF_EXACT, "miss_policy": "substitute", "drain_every": 1000})
    res = engine.residency

    def lowered(batch):
        inputs = engine.loaded.step_inputs(decode_rows(engine, [3, 5]), None, None, batch)
        return engine.runner.lower(inputs).as_text()

    assert res.next_batch().slots.shape == (0,)  # nothing queued
    loops = lowered(res.idle_batch()).count("stablehlo.while")  # the sampler's PRNG has its own
    assert lowered(SwapBatch.of([(0, 1)], res.batch_length)).count("stablehlo.while") == loops + 1
    # warm-up compiles each shape at both lengths (on the exact engine, whose other tests
    # compile the decode shape of this prompt's length too): the prompt's chunk and decode
    # steps at the decode widths of its end and of no lane decoding
    n = len(PROMPT)
    assert half.scheduler.warmup([n]) == 2 * len(half.loaded.warmup_shapes([n])) == 8


@pytest.mark.parametrize("which", ["resident", "half"], ids=["all_resident", "half_exact"])
def test_the_state_is_donated_into_every_step(request, which):
    engine = request.getfixturevalue(which)
    # positions 12, 13: the decode shape (two pages) the other tests on these engines compile
    for function in (lambda: engine.step(decode_rows(engine, [12, 13]), None),
                     lambda: engine.logits(PROMPT)):
        before = engine.state
        function()
        # all but the expert rows no step writes (the host pool; the bank when all resident),
        # which stay whole to rebuild from after a failed step, and are the same arrays after
        leaves = jax.tree.leaves(before.replace(experts=before.experts.without_rows()))
        assert leaves and all(leaf.is_deleted() for leaf in leaves)
        rows = jax.tree.leaves(before.experts.rows)
        assert rows and not any(leaf.is_deleted() for leaf in rows)
        assert all(a is b for a, b in zip(rows, jax.tree.leaves(engine.state.experts.rows)))
        assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(engine.state))


def test_lane_sampling_is_set_at_admission_not_sent_each_step(resident):
    engine = resident
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=12)
    seen = []

    def on_event(event):
        if isinstance(event, TokenEvent) and not seen:
            lanes = engine.state.sampling.params
            seen.append((float(lanes.temperature[0]), int(lanes.top_k[0]), int(lanes.seed[0])))

    engine.scheduler.submit(GenerationRequest(PROMPT, 3, sampling, ignore_eos=True), on_event)
    engine.scheduler.run_until_idle()
    assert seen == [(pytest.approx(0.7), 5, 12)]
    assert float(engine.state.sampling.params.temperature[0]) == 0.0  # the lane went back to greedy


def test_logits_while_serving_runs_on_the_scheduler_thread_and_corrupts_nothing(half):
    engine = half
    request = GenerationRequest(PROMPT, 40, ignore_eos=True)
    alone = []
    engine.scheduler.submit(request, lambda e: alone.append(e.token_id)
                            if isinstance(e, TokenEvent) else None)
    engine.scheduler.run_until_idle()
    idle_logits = engine.logits(PROMPT[:7])

    engine.scheduler.start()
    try:
        done, tokens = threading.Event(), []

        def on_event(event):
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
            elif isinstance(event, DoneEvent):
                done.set()

        engine.scheduler.submit(request, on_event)
        scored = []
        while not done.is_set() or not scored:
            scored.append(engine.logits(PROMPT[:7]))  # between the serving thread's steps
        with pytest.raises(RuntimeError, match="owns the device"):
            engine.step(decode_rows(engine, [3, 5]), None)
        assert done.wait(60)
    finally:
        engine.scheduler.stop()
    assert len(scored) > 1
    assert tokens == alone  # greedy tokens of the decoding request unchanged
    for logits in scored:
        np.testing.assert_array_equal(logits, idle_logits)
