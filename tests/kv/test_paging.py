"""The paged KV pool: preempted requests resume exactly, a long prompt is prefilled in chunks
beside decoding lanes that keep getting a token every step, a decode step costs what the
sequences hold, not max_context (XLA's cost analysis of the compiled step), and prompt caching:
a prompt that starts with an earlier sequence's tokens shares its full pages and prefills only
the rest, with the tokens of an uncached run."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import tidejax
from tidejax.runtime.sampling import SamplingParams
from tidejax.runtime.scheduler import GenerationRequest
from tidejax.errors import ConfigError
from tidejax.kv.pages import PageTable, block_hashes, page_bucket
from tests.support.engine_probes import decode_cost, prefilled, serve, tokens_of

PROMPTS = [np.random.RandomState(s).randint(3, 256, n).tolist() for s, n in ((1, 20), (2, 9))]
LONG = np.random.RandomState(4).randint(3, 256, 70).tolist()
# one prefill bucket (16) for every chunk: few compiled step shapes
ENGINE = {"lanes": 2, "max_context": 96, "page_size": 8, "prefill_chunk": 16}
# two layers, the dense first layer and a MoE layer (paging is not about depth)


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v3", "qlora_groups", seed=5, num_hidden_layers=2)


@pytest.fixture(scope="module")
def engine(model_dir):
    """A pool of 18 pages of 8 tokens, 1.5 sequences at max_context: one engine (one set of
    compiled steps) preempts two long requests and serves each alone or a long prompt beside
    a shorter request without preempting. No host tier: evicted pages are gone."""
    return tidejax.load(model_dir, engine={**ENGINE, "kv_pool_tokens": 144},
                        cache={"host_gib": 0})  # the device tier alone (test_tiers.py: the others)


@pytest.fixture(scope="module")
def reference(engine):
    """Greedy tokens by full forwards (Engine.logits argmax: the scoring forward over a scratch
    cache of its own, not the step): no pages, no lanes."""
    scorer = engine

    def greedy(prompt: list[int], n: int) -> list[int]:
        ids = []
        while len(ids) < n:
            ids.append(int(np.argmax(scorer.logits(list(prompt) + ids)[-1])))
        return ids
    return greedy


def collect(engine, requests):
    events = [[] for _ in requests]
    for i, request in enumerate(requests):
        engine.scheduler.submit(request, events[i].append)
    return events


def test_page_table_hands_out_and_takes_back():
    table = PageTable(6, 4)
    assert table.grow(1, 9) == [0, 1, 2] and table.grow(1, 12) == [0, 1, 2]
    assert table.shortfall(2, 13) == 4 and table.free == 3
    with pytest.raises(RuntimeError, match="4 pages wanted, 3 free"):
        table.grow(2, 13)
    table.release(1)
    assert table.free == 6 and table.grow(2, 13) == [0, 1, 2, 3]
    table.shrink(2, 5)  # the pages past position 4's (speculative decoding's rejected drafts)
    assert table.pages_of(2) == [0, 1] and table.free == 4
    table.shrink(2, 8)
    assert table.pages_of(2) == [0, 1] and table.grow(2, 9) == [0, 1, 2]
    assert [page_bucket(n, 64) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 64]


def test_page_table_shares_cached_pages_and_evicts_the_oldest():
    """Pages of 4 in a pool of 6: a sequence's published full pages stay cached once released,
    a prompt with the same first tokens matches them (the chain stops at the first page that
    differs), and taking more pages than are unused evicts the least recently released, the
    tail of a sequence before its head."""
    table = PageTable(6, 4)
    tokens = list(range(10, 22))  # three full pages
    hashes = block_hashes(tokens, 4)
    assert len(hashes) == 3 and block_hashes(tokens[:9], 4) == hashes[:2]
    assert block_hashes([99] + tokens[1:], 4)[1] != hashes[1]  # chained: page 1 sees page 0
    assert table.grow(1, 13) == [0, 1, 2, 3]
    table.publish(1, hashes)
    table.release(1)
    assert (table.in_use, table.cached, table.free) == (0, 3, 6)
    assert table.match(hashes) == [0, 1, 2]
    assert table.match(block_hashes(tokens[:4] + [0] * 8, 4)) == [0]
    assert table.takes(13, [0, 1]) == 4  # 2 added, 2 cached ones taken back into use
    table.share(2, [0, 1])
    assert table.grow(2, 13) == [0, 1, 3, 4] and (table.in_use, table.cached) == (4, 1)
    assert table.grow(3, 8) == [5, 2] and table.evictions == 1  # page 2, the last cached one
    assert table.match(hashes) == [0, 1]
    table.release(2)
    table.release(3)
    assert table.free == 6 and table.cached == 2
    table.drop_cached()
    assert table.cached == 0 and table.match(hashes) == [] and table.free == 6


def test_a_second_turn_prefills_only_its_new_tokens(engine, reference):
    """Turn 1 (21 tokens: two full pages and 5 positions of a third) generates 12 tokens;
    its steps wrote 32 positions (the last token is never a step's input): four full pages.
    Turn 2 (turn 1, its answer and 5 new tokens: 38, ending inside a page) matches them and
    prefills 6 tokens; a prompt of exactly those 32 tokens matches 3 pages (its last token
    must run for the first sampled token). Greedy and sampled tokens (a repetition penalty
    over the cached prompt tokens too) equal those of the same engine without the cache."""
    scheduler = engine.scheduler
    first = np.random.RandomState(11).randint(3, 256, 21).tolist()
    answer, stats = serve(engine, first, 12)
    assert answer == reference(first, 12)
    second = first + answer + [7, 8, 9, 10, 11]
    sampled = SamplingParams(temperature=0.9, seed=5, repetition_penalty=1.5)
    scheduler.caching = False
    try:
        uncached = [serve(engine, second, 6)[0], serve(engine, second, 6, sampled)[0]]
    finally:
        scheduler.caching = True
    (got, stats), count = prefilled(engine, lambda: serve(engine, second, 6))
    assert stats["cached_tokens"] == 32 and count == len(second) - 32 == 6
    assert got == uncached[0] == reference(second, 6)
    assert serve(engine, second, 6, sampled)[0] == uncached[1]
    (got, stats), count = prefilled(engine, lambda: serve(engine, second[:32], 4))
    assert stats["cached_tokens"] == 24 and count == 8
    assert got == reference(second[:32], 4)
    assert scheduler.cache_stats()["matched_tokens"] >= 32 + 32 + 24


def test_concurrent_requests_share_one_prefixs_pages(engine, reference):
    """Two requests with one 30-token prefix (a request's n choices are such a pair): the
    second waits for the first's prefill and shares its three full pages, so while both
    decode the pool holds three pages fewer than two uncached sequences."""
    scheduler = engine.scheduler
    prefix = np.random.RandomState(12).randint(3, 256, 30).tolist()
    prompts = [prefix + [5, 6], prefix + [9]]
    events = collect(engine, [GenerationRequest(p, 10, ignore_eos=True) for p in prompts])
    in_use = 0
    while any(not tokens_of(e) for e in events):
        scheduler.step()
        in_use = max(in_use, scheduler.pages.in_use)
    assert in_use == 5 + 4 - 3  # pages_for(33) + pages_for(32) - the shared ones
    scheduler.run_until_idle()
    assert [e[-1].stats["cached_tokens"] for e in events] == [0, 24]
    assert [tokens_of(e) for e in events] == [reference(p, 10) for p in prompts]


def test_a_pool_too_small_for_every_prefix_evicts_and_serves_right(engine, reference):
    """Seven 40-token prompts of 8 tokens each, one after another, leave 5 full pages each: more
    than the pool's 18, so the oldest are evicted. The newest still matches, the oldest no
    longer does, and each serves the tokens of a full forward; no page is lost."""
    scheduler = engine.scheduler
    evictions = scheduler.cache_stats()["evictions"]
    prompts = [np.random.RandomState(20 + i).randint(3, 256, 40).tolist() for i in range(7)]
    for prompt in prompts:
        serve(engine, prompt, 8)
    assert scheduler.cache_stats()["evictions"] > evictions
    newest, stats = serve(engine, prompts[-1] + [3], 4)
    assert stats["cached_tokens"] == 40 and newest == reference(prompts[-1] + [3], 4)
    oldest, stats = serve(engine, prompts[0] + [3], 4)
    assert stats["cached_tokens"] == 0 and oldest == reference(prompts[0] + [3], 4)
    stats = scheduler.kv_stats()
    assert stats["pages_in_use"] == 0 and stats["pages_free"] == stats["kv_pages"]


def test_a_preempted_requests_pages_are_matched_after(engine, reference):
    """The pair of test_preempted_requests_resume_exactly (the newer one preempted, its pages
    read to host memory and written back into other pages): a next turn of the preempted
    request matches the pages it held at its end, and serves the tokens of a full forward."""
    scheduler = engine.scheduler
    preemptions = scheduler.totals["preemptions"]
    events = collect(engine, [GenerationRequest(PROMPTS[0], 60, ignore_eos=True),
                              GenerationRequest(PROMPTS[1], 60, ignore_eos=True)])
    scheduler.run_until_idle()
    assert scheduler.totals["preemptions"] > preemptions
    following = PROMPTS[1] + tokens_of(events[1])[:40] + [5, 6, 7]
    got, stats = serve(engine, following, 4)
    assert stats["cached_tokens"] == 48 and got == reference(following, 4)


def test_preempted_requests_resume_exactly(engine, reference):
    """Two lanes, a pool of 18 pages of 8 tokens: two requests growing to 80 and 69 positions
    need 19, so the newest is preempted (its pages and its lane's token counts to host memory)
    and resumes where it was; greedy and sampled tokens (penalized by the counts) are those of an
    unpreempted run (each request alone, on the same engine)."""
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3, presence_penalty=1.0,
                             frequency_penalty=0.5, repetition_penalty=1.3)
    requests = [GenerationRequest(PROMPTS[0], 60, ignore_eos=True),
                GenerationRequest(PROMPTS[1], 60, sampled, ignore_eos=True)]
    preemptions = engine.scheduler.kv_stats()["preemptions"]
    events = collect(engine, requests)
    engine.scheduler.run_until_idle()
    stats = engine.scheduler.kv_stats()
    assert stats["preemptions"] > preemptions and stats["pages_in_use"] == 0, stats
    preemptions = stats["preemptions"]
    alone = []
    for request in requests:
        alone += collect(engine, [request])
        engine.scheduler.run_until_idle()
    assert engine.scheduler.kv_stats()["preemptions"] == preemptions
    assert tokens_of(events[0]) == reference(PROMPTS[0], 60) == tokens_of(alone[0])
    assert tokens_of(events[1]) == tokens_of(alone[1]) and len(tokens_of(events[1])) == 60


def test_long_prompt_prefills_beside_a_decoding_lane(engine, reference):
    """A 70-token prompt arrives while a lane decodes; at prefill_chunk 16 it takes five steps,
    and the decoding lane gets a token in every one of them (steps counted, not time)."""
    scheduler = engine.scheduler
    preemptions = scheduler.totals["preemptions"]
    decoding, admitted = [], []
    scheduler.submit(GenerationRequest(PROMPTS[0], 30, ignore_eos=True), decoding.append)
    for _ in range(3):
        scheduler.step()
    scheduler.submit(GenerationRequest(LONG, 6, ignore_eos=True), admitted.append)
    per_step = []
    while not tokens_of(admitted):
        before = len(tokens_of(decoding))
        scheduler.step()
        per_step.append(len(tokens_of(decoding)) - before)
    assert len(per_step) >= 5 and per_step == [1] * len(per_step), per_step
    scheduler.run_until_idle()
    assert tokens_of(admitted) == reference(LONG, 6)
    assert tokens_of(decoding) == reference(PROMPTS[0], 30)
    assert scheduler.totals["preemptions"] == preemptions  # 7 + 10 pages at most: no preemption


def test_pool_smaller_than_one_sequence_fails_at_start(model_dir):
    with pytest.raises(ConfigError, match="engine.kv_pool_tokens.*less than one sequence"):
        tidejax.load(model_dir, engine={"max_context": 96, "kv_pool_tokens": 64})


def test_decode_cost_does_not_grow_with_max_context(tiny_checkpoint):
    """Same position, max_context 1,024 against 65,536 (one pool size): the same cost within 5%;
    and position 4,000 costs more than position 20, so the measure sees attention."""
    model = tiny_checkpoint("deepseek_v3", "qlora_groups", seed=2, num_hidden_layers=2,
                            max_position_embeddings=65536)
    costs = {}
    for max_context in (1024, 65536):
        engine = tidejax.load(model, engine={"lanes": 2, "max_context": max_context,
                                                "page_size": 64, "kv_pool_tokens": 65536})
        assert engine.max_context == max_context
        costs[max_context] = decode_cost(engine, 20)
    for short, long in zip(costs[1024], costs[65536]):
        assert abs(long - short) <= 0.05 * short, costs
    far = decode_cost(engine, 4000)  # the weights' bytes dominate; attention's flops show
    assert far[0] > 5 * costs[65536][0] and far[1] > 1.1 * costs[65536][1], (far, costs)


def _causal_attention_f64(q, q_rope, latent, rope, positions, scale):
    """float64 numpy: queries [t, h, c|r] at positions [t] over keys [s, c|r]."""
    q, q_rope, latent, rope = (np.asarray(a, np.float64) for a in (q, q_rope, latent, rope))
    scores = (np.einsum("thc,sc->hts", q, latent) + np.einsum("thr,sr->hts", q_rope, rope)) * scale
    scores = np.where(np.arange(len(latent))[None, None] <= np.asarray(positions)[None, :, None],
                      scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hts,sc->thc", probs, latent)


@pytest.mark.parametrize("t, start", [(2 * 256, 40), (48, 500), (16, 3)])
def test_a_chunk_attends_its_pages_key_block_by_key_block(t, start):
    """A prompt chunk's attention (query blocks of QUERY_BLOCK, key blocks of KEY_BLOCK with a
    running max and sum, stopping at the chunk's last position) equals float64 causal attention
    over the row's pages in table order: across key blocks, with pages out of order, for chunks
    that end before the table's last page."""
    import jax.numpy as jnp

    from tidejax import ops as paged
    rng = np.random.RandomState(t)
    q, q_rope = (jnp.asarray(rng.randn(1, t, 2, n), jnp.float32) for n in (8, 4))
    latent_pages, rope_pages = (jnp.asarray(rng.randn(80, 16, n), jnp.float32) for n in (8, 4))
    table = rng.permutation(80)[:64][None].astype(np.int32)  # 1,024 positions: two key blocks
    positions = np.arange(t)[None] + start
    got = paged.mla_attention(q, q_rope, latent_pages, rope_pages, jnp.asarray(table),
                              jnp.asarray(positions), scale=0.3)
    latent = np.asarray(latent_pages)[table[0]].reshape(-1, 8)
    rope = np.asarray(rope_pages)[table[0]].reshape(-1, 4)
    want = _causal_attention_f64(q[0], q_rope[0], latent, rope, positions[0], 0.3)
    np.testing.assert_allclose(np.asarray(got[0]), want, atol=2e-5, rtol=1e-5)


# A workload that passes through every state a request can be in: A and B grow past the pool
# (B, the newer, is preempted, then resumes once A ends), C's 70-token prompt waits in the queue
# and then prefills in five chunks.
WORKLOAD = [(PROMPTS[0], 60), (PROMPTS[1], 60), (LONG, 4)]
STATES = ("queued", "prefilling", "decoding", "preempted", "resuming")


def state_of(scheduler, handle, preempted: set) -> str | None:
    """A request's state as the scheduler holds it; `preempted` collects the ids of those
    preempted so far (one back in a lane is resuming until its next step)."""
    if handle in scheduler.queue:
        if handle.saved is not None:
            preempted.add(handle.id)
            return "preempted"
        return "queued"
    if handle not in scheduler.lane_of:
        return None
    if handle.id in preempted:
        preempted.discard(handle.id)
        return "resuming"
    return "prefilling" if handle is scheduler._prefilling else "decoding"


def run_workload(engine, victim_state: str | None = None):
    """The workload, step by step; with `victim_state`, the first request seen in that state at
    two steps running (resuming lasts one) is cancelled there, past its entry into it: queued
    behind a lane in use, prefilling with a chunk written, decoding with a token out. The
    events of each request, the victim's index and the states seen."""
    scheduler = engine.scheduler
    events = [[] for _ in WORKLOAD]
    handles = [scheduler.submit(GenerationRequest(p, n, ignore_eos=True), events[i].append)
               for i, (p, n) in enumerate(WORKLOAD)]
    preempted, seen, victim = set(), set(), None
    times = collections.Counter()  # (request, state) -> steps seen in it
    while True:
        for i, handle in enumerate(handles):
            state = state_of(scheduler, handle, preempted)
            seen.add(state)
            times[i, state] += 1
            if (victim is None and state == victim_state
                    and times[i, state] == (1 if state == "resuming" else 2)):
                victim = i
                handle.cancel()
        if not scheduler.step():
            break
    return events, victim, seen


@pytest.fixture(scope="module")
def undisturbed(engine):
    events, _, seen = run_workload(engine)
    assert set(STATES) <= seen, seen  # the workload meets every state
    return [tokens_of(e) for e in events]


@pytest.mark.parametrize("state", STATES)
def test_cancel_frees_the_lane_and_pages_in_every_state(engine, undisturbed, state):
    """A request cancelled queued, prefilling, decoding, preempted (its copy in host memory)
    or resuming ends "cancelled" and leaves nothing held: every page free, every lane empty,
    no saved copy kept; the others get the tokens they get undisturbed."""
    scheduler = engine.scheduler
    assert scheduler.pages.free == scheduler.pages.n_pages
    events, victim, _ = run_workload(engine, state)
    assert victim is not None, f"no request was {state}"
    assert scheduler.pages.free == scheduler.pages.n_pages, scheduler.kv_stats()
    assert scheduler.lane_of == [None] * engine.lanes and not scheduler.queue
    assert scheduler._prefilling is None and engine.runner.copies == {}
    for i, got in enumerate(events):
        tokens = tokens_of(got)
        if i == victim:
            assert got[-1].finish_reason == "cancelled"
            assert tokens == undisturbed[i][:len(tokens)]
        else:
            assert got[-1].finish_reason == "length" and tokens == undisturbed[i]
