"""The scheduler's pipelined decode (one step in flight, tokens fed on the device) against
sequential greedy decoding, stops and cancellation mid-stream, and routing replay on the device."""

from __future__ import annotations

import numpy as np
import pytest

import tidejax
from tidejax.runtime.steps import DecodeRows, PrefillChunk, replay_stride, replay_windows
from tidejax.runtime.sampling import SamplingParams
from tidejax.runtime.scheduler import DoneEvent, GenerationRequest
from tests.support.engine_probes import run, tokens_of

# few compiled step shapes: every prompt one chunk of one bucket (16) on one page, every
# sequence at most 32 positions (two pages)
PROMPTS = [np.random.RandomState(s).randint(3, 256, n).tolist() for s, n in ((1, 14), (2, 9), (3, 11))]
ENGINE = {"lanes": 2, "max_context": 32, "page_size": 16, "prefill_chunk": 16}


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v3", "qlora_groups", seed=5)


@pytest.fixture(scope="module")
def resident(model_dir):
    return tidejax.load(model_dir, engine=ENGINE)


@pytest.fixture(scope="module", params=["all_resident", "half_exact"])
def engine(request, model_dir, resident):
    """All experts resident, or half of them with misses fetched exactly while the manager
    drains, plans and swaps every few steps (the same tokens either way)."""
    if request.param == "all_resident":
        return resident
    return tidejax.load(model_dir, engine=ENGINE, residency={
        "budget_experts": 8, "miss_policy": "exact", "drain_every": 3, "half_life": 4.0})


@pytest.fixture(scope="module")
def reference(resident):
    """Sequential greedy decoding by full forwards (Engine.logits argmax: the scoring forward
    over a scratch cache of its own, not the step), no cache, no lanes."""
    scorer = resident
    cache = {}

    def greedy(prompt: list[int], n: int) -> list[int]:
        key = tuple(prompt)
        ids = list(cache.get(key, []))
        while len(ids) < n:
            ids.append(int(np.argmax(scorer.logits(list(prompt) + ids)[-1])))
        cache[key] = ids
        return ids[:n]
    return greedy


def test_pipelined_decode_equals_sequential_greedy(engine, reference):
    """Three requests through two lanes (the third joins when a lane frees), each token fed from
    the previous step's output on the device."""
    steps = engine.scheduler.totals["steps"]
    events = run(engine, [GenerationRequest(p, 14, ignore_eos=True) for p in PROMPTS])
    for prompt, got in zip(PROMPTS, events):
        assert tokens_of(got) == reference(prompt, 14)
        assert isinstance(got[-1], DoneEvent) and got[-1].finish_reason == "length"
        assert got[-1].stats["completion_tokens"] == 14 and len(got) == 15
    # length limits are known ahead: no step runs past them. 13 decode steps a request and one
    # step a prompt chunk: the first prompt alone, the second beside the first's decoding, the
    # third once both lanes' requests have ended (the first lane frees when its last token is
    # read, a step after it was queued): 1 + 1 + 13 + 1 + 13 = 29.
    assert engine.scheduler.totals["steps"] - steps == 29
    compiled = engine.loaded.steps.step.jitted._cache_size()
    run(engine, [GenerationRequest(p, 14, ignore_eos=True) for p in PROMPTS])
    assert engine.loaded.steps.step.jitted._cache_size() == compiled  # drains and swaps compile nothing again
    if not engine.residency.all_resident:  # misses were fetched and swaps ran mid-stream
        stats = engine.residency.stats()
        assert stats["misses"] > 0 and stats["swaps_applied"] > 0, stats


def test_stop_token_ends_a_lane_while_the_other_goes_on(engine, reference):
    """The stopped lane's extra step (queued before its stop token was read) delivers nothing,
    and the request that takes the lane next decodes as if alone."""
    long, short, late = PROMPTS
    ahead = reference(long, 8)
    stop_at = next(i for i in range(3, 8) if ahead[i] not in ahead[:i])
    events = run(engine, [
        GenerationRequest(long, 18, stop_token_ids=(ahead[stop_at],)),
        GenerationRequest(short, 20, ignore_eos=True),
        GenerationRequest(late, 20, ignore_eos=True)])  # queued: it takes the stopped lane
    assert tokens_of(events[0]) == ahead[:stop_at]
    assert len(events[0]) == stop_at + 1 and events[0][-1].finish_reason == "stop"
    assert events[0][-1].stats["completion_tokens"] == stop_at
    assert tokens_of(events[1]) == reference(short, 20)
    # the late request's cache passes the position the stopped lane's extra step wrote
    assert len(late) + 20 > len(long) + stop_at + 1
    assert tokens_of(events[2]) == reference(late, 20)


def test_cancel_mid_stream(engine, reference):
    """A request cancelled from its own token callback gets nothing more, not even the token of
    the step already in flight; the other lane and the queued request are unaffected."""
    def cancel_first_at_5(i, handle, n):
        if i == 0 and n == 5:
            handle.cancel()
    events = run(engine, [GenerationRequest(p, 16, ignore_eos=True) for p in PROMPTS],
                 on_token=cancel_first_at_5)
    assert tokens_of(events[0]) == reference(PROMPTS[0], 5)
    assert len(events[0]) == 6 and events[0][-1].finish_reason == "cancelled"
    for prompt, got in zip(PROMPTS[1:], events[1:]):
        assert tokens_of(got) == reference(prompt, 16) and got[-1].finish_reason == "length"


def test_sampled_tokens_do_not_depend_on_the_neighbour_lane(engine):
    kwargs = dict(sampling=SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=11),
                  ignore_eos=True)
    alone = run(engine, [GenerationRequest(PROMPTS[1], 12, **kwargs)])
    beside = run(engine, [GenerationRequest(PROMPTS[0], 5, **kwargs),
                          GenerationRequest(PROMPTS[1], 12, **kwargs)])
    assert tokens_of(beside[1]) == tokens_of(alone[0])


@pytest.mark.parametrize("max_context", [1024, 2048, 4096])
def test_replay_windows_do_not_repeat_within_n_admissions(max_context):
    """On a trace of N = 4096 rows (data/traces' size), N admissions in a row take N distinct
    windows, whatever max_context shares with N, each a stride >= max_context on (mod N)."""
    stride = replay_stride(max_context, 4096)
    windows = replay_windows(np.arange(4096), max_context, 4096)
    assert stride == max_context + 1 and len(np.unique(windows)) == 4096
    np.testing.assert_array_equal(np.diff(windows) % 4096, stride % 4096)
    assert replay_windows(4096, max_context, 4096) == windows[0] == 0  # then round again


def test_replay_routes_each_token_by_its_window_and_position_on_the_device(model_dir):
    """The trace lives on the device and a token at position p of a lane with window w routes by
    row (w + p) mod N of it, whatever step carries it: the demand counters equal the picks of
    exactly the rows a host-side walk of the steps' positions gives, chunk padding and idle
    lanes routed but not counted."""
    engine = tidejax.load(model_dir, engine=ENGINE, residency={"drain_every": 1000})
    n_moe, n_experts = engine.family.expert_dims(engine.cfg)[:2]
    k = engine.cfg.num_experts_per_tok
    rng = np.random.RandomState(9)
    picks = np.stack([rng.choice(n_experts, k, replace=False)
                      for _ in range(37 * n_moe)]).reshape(37, n_moe, k)
    engine.set_routing_replay(picks)
    before = np.asarray(engine.state.experts.counts).copy()
    want = np.zeros((n_moe, n_experts))
    windows = np.array([5, 40])  # lane 1's past N: taken mod N

    def consume(lanes, positions):  # the real tokens' lanes and positions
        rows = (windows[lanes] + positions) % len(picks)
        for layer in range(n_moe):
            np.add.at(want[layer], picks[rows, layer].reshape(-1), 1)

    pages = engine.scheduler.pages
    long = np.random.RandomState(1).randint(3, 256, 20).tolist()
    for lane, prompt in enumerate([long, PROMPTS[1]]):  # chunks of 4 (padded to 16) and 16, then 9
        held = pages.grow(lane, 32)
        for start, chunk in engine.loaded.chunks(prompt):
            engine.step(None, PrefillChunk(lane, chunk, start, held, window=windows[lane]))
            consume(lane, start + np.arange(len(chunk)))
    previous = None
    for step, active in enumerate([[True, True]] * 5 + [[True, False]] * 3):
        active = np.array(active)
        positions = np.array([20, 9]) + step
        decode = DecodeRows(np.zeros(engine.lanes, np.int32), np.full(engine.lanes, previous is None),
                            positions, active, [pages.pages_of(0), pages.pages_of(1)],
                            windows=windows)
        previous = engine.step(decode, None, previous)
        consume(np.flatnonzero(active), positions[active])
    np.asarray(previous)
    np.testing.assert_array_equal(np.asarray(engine.state.experts.counts) - before, want)
