"""DeepSeek-V4.1 on the paged KV pool (tiny_a: a ratio-2 and a ratio-1 KV source, both indexed):
greedy tokens through small pages and a small pool equal full forwards; a pool too small for
every request preempts, and the preempted request (its pages and its lane's window rings, group
buffers and Engram look-back saved to host memory) resumes with the tokens of an unpreempted run; a decode
step costs what the lane holds, not max_context; the pool's sizing and stats."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import tidejax
from tidejax.errors import ConfigError
from tidejax.runtime.scheduler import GenerationRequest, TokenEvent
from tidejax.runtime.steps import DecodeRows, PrefillChunk
from tests.support.engine_probes import decode_cost

GOLDEN = Path(__file__).parents[1] / "data" / "golden_v41" / "tiny_a"
IDS = np.load(GOLDEN / "input_ids.npy")[0].tolist()
PROMPTS = [IDS[:9], IDS[10:33], IDS[24:64]]  # 9, 23 and 40 tokens


@pytest.fixture(scope="module")
def engine():
    """Three lanes, pages of 32 tokens (16 entries of the ratio-2 source), a pool of 4 pages
    (two sequences at max_context), 16-token prompt chunks."""
    return tidejax.load(GOLDEN, engine={"lanes": 3, "max_context": 64, "prefill_chunk": 16,
                                        "page_size": 32, "kv_pool_tokens": 128})


def reference(engine, prompt: list[int], got: list[int]) -> list[int]:
    """The greedy tokens of full forwards, checked against the engine's `got`: the argmax at each
    position of one forward over prompt + got (Engine.logits: a fresh pool of its own). The
    forward is causal, so position p's logits are those of a forward over the first p + 1
    tokens: this equals `got` exactly where greedy decoding by full forwards gives `got`. Golden
    ids after the sequence fill it to max_context (they change nothing before them): every
    request's forward is one compiled shape."""
    seq = list(prompt) + got[:-1]
    logits = engine.logits(seq + IDS[:engine.max_context - len(seq)])
    return np.argmax(logits[len(prompt) - 1:len(seq)], axis=-1).tolist()


def run(engine, requests) -> list[list[int]]:
    out = [[] for _ in requests]
    for i, request in enumerate(requests):
        engine.scheduler.submit(
            request, lambda e, i=i: out[i].append(e.token_id) if isinstance(e, TokenEvent) else None)
    engine.scheduler.run_until_idle()
    return out


def test_lanes_of_different_lengths_equal_full_forwards(engine):
    """Prompts of 9, 23 and 40 tokens in three lanes (the longer two prefilled in 16-token
    chunks beside the decoding lanes), holding 1, 1 and 2 pages: no preemption."""
    before = engine.scheduler.kv_stats()["preemptions"]
    new = [10, 8, 8]
    got = run(engine, [GenerationRequest(p, n, ignore_eos=True) for p, n in zip(PROMPTS, new)])
    assert engine.scheduler.kv_stats()["preemptions"] == before
    assert [len(g) for g in got] == new
    assert got == [reference(engine, p, g) for p, g in zip(PROMPTS, got)]


def test_a_prompt_chunk_reads_its_engram_rows_on_the_host(engine):
    """A prompt chunk's Engram rows come with its step, read on the host (engram.prompt_rows),
    so the compiled step keeps its one-row-at-a-time read of the tables (the loop at the model's
    top) for the decoding lanes alone: lanes x cols iterations, none of the chunk's 16 x cols.
    The rows the chunk reads are checked by the test above (chunks against full forwards, which
    read in the step)."""
    loaded = engine.loaded
    lanes = np.arange(loaded.lanes)
    decode = DecodeRows(lanes * 0, lanes >= 0, lanes * 0, lanes == 0, [[0]] * loaded.lanes)
    chunk = PrefillChunk(1, IDS[16:32], 16, [1], IDS[:16])
    inputs = loaded.step_inputs(decode, chunk, None, engine.residency.idle_batch())
    assert inputs.prefill.rows is not None
    hlo = engine.runner.lower(inputs).compile().as_text()
    trips = [int(re.search(r'"n":"(\d+)"', line)[1]) for line in hlo.splitlines()
             if " while(" in line and 'op_name="jit(apart)/DeepseekV41/while"' in line]
    assert trips == [loaded.lanes * loaded.cfg.engram_cols]
    with pytest.raises(ValueError, match="needs the 3 tokens before it"):
        loaded.step_inputs(None, PrefillChunk(1, IDS[16:32], 16, [1]), None,
                           engine.residency.idle_batch())


def test_preempted_requests_resume_exactly(engine):
    """Requests growing to 50, 39 and 60 positions need 6 pages of the pool's 4: the newest is
    preempted (its pages, its lane's rings, buffers and Engram look-back to host memory) and
    resumes in whatever lane frees; every request's greedy tokens are those of full forwards."""
    prompts, new = [IDS[:20], IDS[30:39], IDS[24:64]], [30, 30, 20]
    before = engine.scheduler.kv_stats()["preemptions"]
    got = run(engine, [GenerationRequest(p, n, ignore_eos=True) for p, n in zip(prompts, new)])
    stats = engine.scheduler.kv_stats()
    assert stats["preemptions"] > before and stats["pages_in_use"] == 0, stats
    assert [len(g) for g in got] == new
    assert got == [reference(engine, p, g) for p, g in zip(prompts, got)]


def serve(engine, prompt: list[int], n: int) -> tuple[list[int], dict, int]:
    """One greedy request to its end: its tokens, its DoneEvent's stats and the prompt tokens
    the steps prefilled meanwhile."""
    events, before = [], engine.scheduler.totals["prefilled_tokens"]
    engine.scheduler.submit(GenerationRequest(prompt, n, ignore_eos=True), events.append)
    engine.scheduler.run_until_idle()
    got = [e.token_id for e in events if isinstance(e, TokenEvent)]
    return got, events[-1].stats, engine.scheduler.totals["prefilled_tokens"] - before


def test_a_second_turn_prefills_only_its_new_tokens(engine):
    """Turn 1 (32 tokens: one full page) generates 8; its last chunk ends the page, so its
    lane's rows (window rings, group buffers, Engram look-back) are read to host memory with
    the page's index entry. Turn 2 (turn 1, its answer and 5 new tokens: 45) matches the page,
    has that snapshot written into its lane and prefills only the 13 tokens past turn 1; its
    greedy tokens equal the same engine's with the cache off and those of full forwards."""
    scheduler = engine.scheduler
    first = IDS[:32]
    answer, _, _ = serve(engine, first, 8)
    second = first + answer + IDS[50:55]
    scheduler.caching = False
    try:
        uncached, stats, count = serve(engine, second, 6)
    finally:
        scheduler.caching = True
    assert stats["cached_tokens"] == 0 and count == len(second)
    got, stats, count = serve(engine, second, 6)
    assert stats["cached_tokens"] == 32 and count == len(second) - len(first) == 13
    assert got == uncached == reference(engine, second, got)
    stats = scheduler.kv_stats()  # the runners hold the snapshots alone: no request is saved
    assert stats["lane_snapshots"] >= 1 and stats["lane_snapshot_bytes"] == sum(
        leaf.nbytes for copy in engine.runner.copies.values() for leaf in jax.tree.leaves(copy))


def test_a_prompt_ending_inside_a_page_is_cut_at_its_last_page(engine):
    """A 40-token prompt is chunked 16, 16 and 8 (remainder first up to its last full page,
    then the rest), so a chunk ends that page and leaves a snapshot; the same prompt again
    matches the page and prefills its last 8 tokens, with the first run's tokens."""
    prompt = IDS[20:60]
    assert [(start, len(ids)) for start, ids in engine.loaded.chunks(prompt)] == [
        (0, 16), (16, 16), (32, 8)]
    first, stats, count = serve(engine, prompt, 6)
    assert stats["cached_tokens"] == 0 and count == 40
    again, stats, count = serve(engine, prompt, 6)
    assert stats["cached_tokens"] == 32 and count == 8
    assert again == first == reference(engine, prompt, first)


def test_a_matched_request_is_preempted_and_resumes_exactly(engine):
    """The requests of test_preempted_requests_resume_exactly, the newest (40 tokens) matching
    the first page of an earlier run of its prompt (its snapshot written into its lane): it is
    preempted (its pages and lane rows to host memory) and resumes; the pages the others grow
    into evict the cached one, whose snapshot the runners forget. Every request's tokens are
    those of full forwards, and the runners keep no copy but the snapshots of cached pages."""
    scheduler = engine.scheduler
    prompts, new = [IDS[:20], IDS[30:39], IDS[24:64]], [30, 30, 20]
    serve(engine, prompts[2], 1)
    before, evictions = scheduler.kv_stats(), scheduler.pages.evictions
    events = [[] for _ in prompts]
    for i, (prompt, n) in enumerate(zip(prompts, new)):
        scheduler.submit(GenerationRequest(prompt, n, ignore_eos=True), events[i].append)
    scheduler.run_until_idle()
    after = scheduler.kv_stats()
    assert after["preemptions"] > before["preemptions"], after
    assert [e[-1].stats["cached_tokens"] for e in events] == [0, 0, 32]
    got = [[e.token_id for e in ev if isinstance(e, TokenEvent)] for ev in events]
    assert got == [reference(engine, p, g) for p, g in zip(prompts, got)]
    assert scheduler.pages.evictions > evictions
    assert len(engine.runner.copies) == after["lane_snapshots"]


def test_a_saved_sequence_goes_back_into_any_lane(engine):
    """read_sequence / write_sequence: lane 1's rows, pages and Engram look-back into lane 0."""
    saved = engine.read_sequence([2, 3], 1)
    assert any(np.abs(leaf).sum() > 0 for leaf in jax.tree.leaves(saved.cache.lanes))
    assert np.abs(saved.cache.lanes.engram).sum() > 0
    engine.write_sequence([0, 1], 0, saved)
    again = engine.read_sequence([0, 1], 0)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)


def test_decode_cost_does_not_grow_with_max_context(tmp_path):
    """Same position, max_context 1,024 against 16,384 (one pool size): the same cost within 5%
    (the indexer keys are scored and the picked entries read through the lane's block table);
    position 8,000 costs more than position 20, so the measure sees the compressed attention and
    the indexer (only the top-k entries are read, so the bytes grow less than the row's copy
    did: 4,000 positions added less than a fifth)."""
    model = tmp_path / "tiny_a"
    shutil.copytree(GOLDEN, model)
    raw = json.loads((model / "config.json").read_text())
    raw["text_config"]["max_position_embeddings"] = 16384
    (model / "config.json").write_text(json.dumps(raw))
    costs = {}
    for max_context in (1024, 16384):
        engine = tidejax.load(model, engine={"lanes": 2, "max_context": max_context,
                                             "page_size": 64, "kv_pool_tokens": 16384})
        assert engine.max_context == max_context
        costs[max_context] = decode_cost(engine, 20)
    for short, long in zip(costs[1024], costs[16384]):
        assert abs(long - short) <= 0.05 * short, costs
    far = decode_cost(engine, 8000)
    assert far[0] > 1.4 * costs[16384][0] and far[1] > 1.2 * costs[16384][1], (far, costs)


def test_pool_sizing_and_stats():
    """tiny_a in float32: 384 pool bytes a token (entries + indexer keys: (32 + 32) / 2 for the
    ratio-2 source, 32 + 32 for the ratio-1 one); a lane keeps 6 window rings of 7 x 32, the
    ratio-2 source's two buffers of 2 x 32 and the Engram look-back of 3 ids beside the pool."""
    per_token, lane = 4 * ((32 + 32) / 2 + 32 + 32), 4 * (6 * 7 * 32 + 2 * 2 * 32 + 3)
    engine = tidejax.load(GOLDEN, engine={"lanes": 2, "max_context": 64, "page_size": 16,
                                          "kv_pool_gib": 10 * 16 * per_token / 2**30})
    stats = engine.scheduler.kv_stats()
    assert engine.cache_bytes_per_token() == per_token
    assert (stats["kv_pages"], stats["kv_bytes"]) == (10, 10 * 16 * per_token), stats
    assert (stats["lane_bytes"], stats["lanes_bytes"]) == (lane, 2 * lane), stats
    cache = engine.state.cache
    leaves = jax.tree.leaves(cache.lanes)
    assert sum(leaf.nbytes for leaf in leaves) == 2 * lane
    assert all(leaf.shape[0] == engine.loaded.kv_pages for leaf in jax.tree.leaves(cache.pages))


def test_page_size_must_hold_whole_groups():
    with pytest.raises(ConfigError, match=r"engine.page_size' = 1 must be a multiple of 2"):
        tidejax.load(GOLDEN, engine={"max_context": 64, "page_size": 1})

