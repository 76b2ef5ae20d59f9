"""Speculative decoding in the engine (issue 33): a tiny DeepSeek-V3 with one MTP layer that
drafts well (tiny_models.repeating_mtp), served with `[speculative] method = "mtp"` against the
same checkpoint with it off: greedy output token for token, alone and in four lanes of a pool
small enough to preempt, and with requests arriving mid-decode (their prompt chunks in the
verify steps, each step queued before the one before it is read); sampled output against the
distribution the plain sampler draws from; the stats through the live server and the openai
client."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest
from scipy.stats import chi2

import tidejax
from tidejax.kv.pages import pages_for
from tidejax.runtime.client import LocalEngineClient
from tidejax.runtime.runner import Runner, StepResult
from tidejax.runtime.sampling import (LaneParams, LaneSampling, SamplingParams, probabilities,
                                      process)
from tidejax.runtime.scheduler import DoneEvent, GenerationRequest, Scheduler, TokenEvent
from tidejax.server.app import Server
from tests.support.engine_probes import run, tokens_of
from tests.support.server_fixtures import serve_app

K = 2  # drafts a lane a step
# a pool of 64 tokens (8 pages) for four lanes of up to 32: preemption; warm-up off (the steps
# compile as the requests meet them)
ENGINE = {"lanes": 4, "max_context": 32, "page_size": 8, "prefill_chunk": 16,
          "kv_pool_tokens": 64, "warmup": False}
PROMPTS = [np.random.RandomState(s).randint(3, 256, n).tolist()
           for s, n in ((1, 14), (2, 9), (3, 11), (4, 6))]
NEW = 16


@pytest.fixture(scope="module")
def plain(v3_mtp):
    return tidejax.load(v3_mtp, engine=ENGINE)


@pytest.fixture(scope="module")
def speculating(v3_mtp):
    return tidejax.load(v3_mtp, engine=ENGINE, speculative={"method": "mtp", "tokens": K})


def greedy(engine, prompts):
    """Each prompt's NEW greedy tokens (eos ignored), all submitted at once, and the last
    request's stats."""
    events = run(engine, [GenerationRequest(p, NEW, ignore_eos=True) for p in prompts])
    for got in events:
        assert isinstance(got[-1], DoneEvent) and got[-1].finish_reason == "length"
    return [tokens_of(got) for got in events], [got[-1].stats for got in events]


def test_greedy_output_is_the_plain_engines_alone_and_in_four_preempting_lanes(plain,
                                                                              speculating):
    """One request alone, then four together in a pool that holds two of them: the tokens are
    those of the engine without speculation, token for token, and a stop token ends a request
    where it comes; drafts were accepted and rejected, lanes were preempted and resumed while
    speculating, and no page is held after."""
    alone, stats = greedy(speculating, PROMPTS[:1])
    assert alone == greedy(plain, PROMPTS[:1])[0]
    assert 0 < stats[0]["accepted_tokens"] <= stats[0]["drafted_tokens"]
    assert stats[0]["acceptance"] == stats[0]["accepted_tokens"] / stats[0]["drafted_tokens"]
    # fewer steps than tokens: 1 prefill step + verify steps each emitting 1..K+1 tokens
    before = speculating.scheduler.totals["steps"]
    greedy(speculating, PROMPTS[:1])
    assert speculating.scheduler.totals["steps"] - before < NEW
    # a stop token ends the request there, whichever of a step's tokens it is
    stop = alone[0][NEW // 2]
    events = run(speculating, [GenerationRequest(PROMPTS[0], NEW, stop_token_ids=(stop,),
                                                 ignore_eos=True)])[0]
    assert tokens_of(events) == alone[0][:alone[0].index(stop)]
    assert events[-1].finish_reason == "stop"

    preempted = speculating.scheduler.totals["preemptions"]
    together, stats = greedy(speculating, PROMPTS)
    want, _ = greedy(plain, PROMPTS)
    print(f"accepted {[s['accepted_tokens'] for s in stats]} of "
          f"{[s['drafted_tokens'] for s in stats]} drafts")
    assert together == want
    assert speculating.scheduler.totals["preemptions"] > preempted
    assert 0 < sum(s["accepted_tokens"] for s in stats) < sum(s["drafted_tokens"] for s in stats)
    assert speculating.scheduler.pages.in_use == 0


def staggered(engine, prompts, after: int):
    """Each prompt's NEW greedy tokens (eos ignored): the first submitted alone, each next one
    once the one before it has `after` tokens, so that its prompt's chunks are planned while
    the others decode."""
    events = [[] for _ in prompts]

    def submit(i):
        def on_event(event):
            events[i].append(event)
            if (i + 1 < len(prompts) and isinstance(event, TokenEvent)
                    and len(tokens_of(events[i])) == after):
                submit(i + 1)
        engine.scheduler.submit(GenerationRequest(prompts[i], NEW, ignore_eos=True), on_event)

    submit(0)
    engine.scheduler.run_until_idle()
    for got in events:
        assert isinstance(got[-1], DoneEvent) and got[-1].finish_reason == "length"
    return [tokens_of(got) for got in events]


@pytest.fixture
def step_order(monkeypatch):
    """The order in which steps are queued and their tokens read: ("queued", n), ("read", n)
    for step n (StepResult.step), appended as the runner and the scheduler do them."""
    order = []
    run, tokens = Runner.run, StepResult.tokens

    def queued(self, plan):
        result = run(self, plan)
        if result.step is not None:
            order.append(("queued", result.step))
        return result

    def read(self):
        order.append(("read", self.step))
        return tokens(self)

    monkeypatch.setattr(Runner, "run", queued)
    monkeypatch.setattr(StepResult, "tokens", read)
    return order


@pytest.fixture
def pages_kept(monkeypatch):
    """After each step is read: every page the step in flight writes for a lane it goes on
    with is still that lane's, at the same place of its table (pages the reading gives back
    must be past those writes); a Counter of the checks, and of those whose writes reached a
    page past the lane's latest position's (which giving back everything past that position
    would have freed under the step in flight)."""
    counts, tables = collections.Counter(), {}
    run, deliver = Runner.run, Scheduler._deliver

    def queued(self, plan):
        result = run(self, plan)
        if plan.verify:
            tables[result.step] = [list(pages) for pages in plan.decode.pages]
        return result

    def read(self, step):
        deliver(self, step)
        flight = self._in_flight
        if flight is None or flight.continues is None:
            return
        for lane, handle in enumerate(flight.handles):
            if not (flight.continues[lane] and self.lane_of[lane] is handle):
                continue
            writes = pages_for(self._reach(self.positions[lane]), self.pages.page_size)
            held = self.pages.pages_of(handle.id)
            assert held[:writes] == tables[flight.result.step][lane][:writes]
            counts["checked"] += 1
            counts["past_latest"] += writes > pages_for(int(self.positions[lane]) + 1,
                                                        self.pages.page_size)

    monkeypatch.setattr(Runner, "run", queued)
    monkeypatch.setattr(Scheduler, "_deliver", read)
    return counts


def test_prompts_arriving_mid_decode_ride_in_verify_steps(plain, speculating, step_order,
                                                          pages_kept):
    """A request arriving while one lane speculates, then four arriving one after another in a
    pool that holds two of them: each request's tokens are the plain engine's; its prompt
    chunks went into steps that judged the other lanes' drafts (counted), lanes were preempted
    and resumed, each step was queued before the tokens of the one before it were read, and
    the pages of the step in flight stayed with their lanes when the one before was read."""
    scheduler, totals = speculating.scheduler, speculating.scheduler.totals
    before = collections.Counter(totals)
    pair = [PROMPTS[0], PROMPTS[2]]
    got = staggered(speculating, pair, 3)
    order = list(step_order)  # the speculating engine's steps alone
    assert got == staggered(plain, pair, 3)
    assert totals["verify_chunk_steps"] > before["verify_chunk_steps"]
    # the pipelining: step n + 1 queued before step n's tokens were read, as often as the
    # scheduler counts it
    overlapped = [n for kind, n in order if kind == "read" and ("queued", n + 1) in order
                  and order.index(("queued", n + 1)) < order.index(("read", n))]
    assert len(overlapped) == totals["overlapped_steps"] - before["overlapped_steps"] > 0

    mixed, preempted = totals["verify_chunk_steps"], totals["preemptions"]
    assert staggered(speculating, PROMPTS, 1) == staggered(plain, PROMPTS, 1)
    assert totals["verify_chunk_steps"] > mixed
    assert totals["preemptions"] > preempted
    assert 0 < totals["accepted_tokens"] - before["accepted_tokens"] < (
        totals["drafted_tokens"] - before["drafted_tokens"])
    assert scheduler.pages.in_use == 0
    print(f"pages of the step in flight checked {dict(pages_kept)}")
    assert pages_kept["past_latest"] > 0


# every sampling parameter the server takes that changes the distribution (thinking budget
# aside: it forces one token), top_k small so that a pair of tokens has few outcomes
SAMPLED = dict(temperature=0.9, top_k=3, top_p=0.97, min_p=0.05, presence_penalty=0.4,
               frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={17: 3.0})
SEEDS = 240  # requests, one seed each
ALARM = 1e-4  # the chi-square bound's false alarm for a correct sampler (the seeds are fixed)


def distribution(engine, context: list[int], generated: list[int], params: SamplingParams):
    """What the plain sampler draws the token after `context` from (sampling.probabilities
    after process), the lane having generated `generated` (the tail of context) -> [vocab]."""
    vocab = engine.loaded.vocab_size
    counts = np.bincount(generated, minlength=vocab).astype(np.int32)[None]
    seen = np.zeros((1, vocab), bool)
    seen[0, context] = True
    lane = LaneSampling(LaneParams.of([params]), counts, seen)
    logits = engine.logits(context)[-1][None]
    return np.asarray(probabilities(process(logits, lane), lane.params))[0]


def test_sampled_pairs_follow_the_plain_samplers_distribution(speculating):
    """SEEDS requests of two tokens, one at a time (so the second comes from a verify step:
    a kept draft or rejection sampling's token): the pairs' frequencies are within the
    chi-square bound of the distribution the plain sampler draws each token from, given the
    one before; drafts were both kept and rejected."""
    prompt = PROMPTS[1]
    scheduler = speculating.scheduler
    drafted, accepted = scheduler.totals["drafted_tokens"], scheduler.totals["accepted_tokens"]
    pairs = []
    for seed in range(SEEDS):
        params = SamplingParams(seed=seed, **SAMPLED)
        events = run(speculating, [GenerationRequest(prompt, 2, params, ignore_eos=True)])[0]
        pairs.append(tuple(tokens_of(events)))
    drafted = scheduler.totals["drafted_tokens"] - drafted
    accepted = scheduler.totals["accepted_tokens"] - accepted
    print(f"{accepted} of {drafted} drafts kept")
    assert 0 < accepted < drafted
    params = SamplingParams(**SAMPLED)
    first = distribution(speculating, prompt, [], params)
    expected = {}
    for x in np.flatnonzero(first):
        second = distribution(speculating, prompt + [int(x)], [int(x)], params)
        for y in np.flatnonzero(second):
            expected[(int(x), int(y))] = first[x] * second[y]
    assert set(pairs) <= set(expected)  # no pair the sampler cannot draw
    cells = sorted(expected)
    want = np.array([expected[c] for c in cells]) * SEEDS
    got = np.array([pairs.count(c) for c in cells])
    stat = float(((got - want) ** 2 / want).sum())
    bound = chi2.ppf(1 - ALARM, len(cells) - 1)
    print(f"chi-square {stat:.1f}, bound {bound:.1f} over {len(cells)} pairs")
    assert stat < bound


def test_stats_through_the_live_server(speculating):
    """x_engine_stats of a completion through the openai client carries the request's drafted
    and accepted tokens and acceptance, its logprobs one a token; /metrics counts the drafts
    since start."""
    import openai
    import urllib.request
    # the warm-up the server runs at start compiles the verify steps: alone and with a chunk
    shapes = speculating.loaded.warmup_shapes([len(PROMPTS[0])])
    assert {size for size, *_ in shapes} == {0, 16}
    speculating.warmup([len(PROMPTS[0])])
    client = LocalEngineClient(speculating)
    asyncio.run(client.start())
    server = Server(speculating.config)
    server.attach(client)
    try:
        with serve_app(server) as url:
            api = openai.OpenAI(base_url=url + "/v1", api_key="none")
            reply = api.completions.create(model=speculating.served_name, prompt=PROMPTS[0],
                                           max_tokens=12, temperature=0, logprobs=2,
                                           extra_body={"ignore_eos": True})
            stats = reply.model_extra["x_engine_stats"]
            assert reply.usage.completion_tokens == 12
            # every token's logprob, those of kept drafts included: greedy, the most likely one
            logprobs = reply.choices[0].logprobs
            assert len(logprobs.token_logprobs) == 12
            for logprob, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
                assert logprob < 0 and logprob == pytest.approx(max(top.values()))
            assert stats["drafted_tokens"] > 0 and stats["accepted_tokens"] > 0
            assert stats["acceptance"] == stats["accepted_tokens"] / stats["drafted_tokens"]
            with urllib.request.urlopen(url + "/metrics") as r:
                metrics = r.read().decode()
            totals = speculating.scheduler.totals
            assert (f"tidejax_speculative_drafted_tokens_total {totals['drafted_tokens']}"
                    in metrics)
            assert (f"tidejax_speculative_accepted_tokens_total {totals['accepted_tokens']}"
                    in metrics)
    finally:
        client.stop()
