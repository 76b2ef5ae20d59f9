"""Sampling on the device, per lane, against numpy references of the same math: the penalties,
logit_bias, the thinking budget and the logprobs on random logits, the draws of top_k / top_p /
min_p against the distribution numpy keeps; then through the engine (its logits from
Engine.logits): penalties and logit_bias changing greedy output as numpy predicts, the logprobs
each token carries, and one compiled step for every mix of parameters."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import tidejax
from tidejax.runtime.sampling import (TOP_LOGPROBS, LaneParams, LaneSampling, SamplingError,
                                      SamplingParams, process, sample)
from tidejax.runtime.scheduler import GenerationRequest, TokenEvent
from tests.support.engine_probes import run, tokens_of

V = 64
SAMPLE = jax.jit(sample)


def np_process(logits, p: SamplingParams, counts, seen):
    """The module docstring's steps 1-4 in numpy (float32)."""
    x = np.asarray(logits, np.float32).copy()
    r = np.float32(p.repetition_penalty)
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    x = x - np.float32(p.frequency_penalty) * counts - np.float32(p.presence_penalty) * (counts > 0)
    for token, bias in p.logit_bias:
        x[token] += np.float32(bias)
    if p.thinking_budget and counts[p.thinking_end] == 0 and counts.sum() >= p.thinking_budget:
        x = np.where(np.arange(len(x)) == p.thinking_end, 0.0, -np.inf)
    return x


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def np_kept(x, p: SamplingParams):
    """The distribution a sampling lane draws from: temperature, then top_k, then top_p and
    min_p over the top_k's renormalized distribution; [v] probabilities."""
    order = np.argsort(-x, kind="stable")
    scaled = x[order].astype(np.float64) / p.temperature
    rank = np.arange(len(x))
    keep = rank < p.top_k if p.top_k else np.ones(len(x), bool)
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    keep &= (np.cumsum(probs) - probs < p.top_p) | (rank == 0)
    keep &= probs >= p.min_p * probs[0]
    final = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    out = np.zeros(len(x))
    out[order] = final / final.sum()
    return out


def lanes_of(params: list[SamplingParams], counts, seen) -> LaneSampling:
    return LaneSampling(LaneParams.of(params), np.asarray(counts, np.int32), np.asarray(seen))


LANES = [
    SamplingParams(),
    SamplingParams(presence_penalty=1.5, frequency_penalty=-0.7, logprobs=3),
    SamplingParams(repetition_penalty=1.8, logit_bias={5: 7.5, 9: -100.0}, logprobs=0),
    SamplingParams(thinking_budget=4, thinking_end=11, logprobs=TOP_LOGPROBS),
    SamplingParams(thinking_budget=4, thinking_end=12),  # 12 was generated: no longer forced
    SamplingParams(thinking_budget=100, thinking_end=11),  # under its budget
]


def test_penalties_bias_budget_and_logprobs_match_numpy():
    rng = np.random.RandomState(0)
    logits = rng.normal(0, 2, (len(LANES), V)).astype(np.float32)
    counts = rng.poisson(0.3, (len(LANES), V))
    counts[:, 11] = 0
    counts[4, 12] = 1
    seen = (counts > 0) | (rng.rand(len(LANES), V) < 0.2)
    lanes = lanes_of(LANES, counts, seen)
    want = np.stack([np_process(logits[i], p, counts[i], seen[i]) for i, p in enumerate(LANES)])
    got = np.asarray(jax.jit(process)(logits, lanes))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got[1:3], logits[1:3])  # the penalties and the bias did something
    assert np.isneginf(got[3]).sum() == V - 1 and got[3, 11] == 0  # the budget forced token 11
    out = SAMPLE(logits, lanes, np.zeros(len(LANES), np.int32))
    np.testing.assert_array_equal(np.asarray(out.tokens), want.argmax(-1))
    assert out.tokens[3] == 11 and np.isfinite(got[4:]).all()
    for i in range(len(LANES)):
        logp = np_log_softmax(want[i])
        assert out.logprob[i] == pytest.approx(max(logp[want[i].argmax()], -9999.0), abs=1e-5)
        top = np.argsort(-logp, kind="stable")[:TOP_LOGPROBS]
        if i != 3:  # lane 3's alternatives are all -inf: any order
            np.testing.assert_array_equal(np.asarray(out.top_ids[i]), top)
        np.testing.assert_allclose(np.asarray(out.top_logprobs[i]),
                                   np.maximum(logp[top], -9999.0), atol=1e-5)


def test_no_lane_asking_for_logprobs_skips_them():
    logits = np.random.RandomState(1).normal(0, 1, (len(LANES), V)).astype(np.float32)
    params = [dataclasses.replace(p, logprobs=None, temperature=0.5) for p in LANES]
    lanes = lanes_of(params, np.zeros((len(LANES), V)), np.zeros((len(LANES), V), bool))
    out = SAMPLE(logits, lanes, np.zeros(len(LANES), np.int32))
    assert not np.asarray(out.logprob).any() and not np.asarray(out.top_ids).any()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=6),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.15),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.9, min_p=0.05, presence_penalty=1.0),
], ids=["top_k", "top_p", "min_p", "all"])
def test_draws_follow_the_distribution_numpy_keeps(params):
    """4,000 draws of one row (one lane a position, each its own key): every draw in the kept
    set, the frequencies within 0.05 (total variation) of numpy's truncated softmax."""
    n = 4000
    rng = np.random.RandomState(2)
    row = rng.normal(0, 2, V).astype(np.float32)
    counts = (rng.rand(V) < 0.2).astype(np.int32)
    lanes = lanes_of([dataclasses.replace(params, seed=7)] * n, np.tile(counts, (n, 1)),
                     np.tile(counts > 0, (n, 1)))
    out = SAMPLE(np.tile(row, (n, 1)), lanes, np.arange(n, dtype=np.int32))
    want = np_kept(np_process(row, params, counts, counts > 0), params)
    drawn = np.bincount(np.asarray(out.tokens), minlength=V) / n
    assert set(np.flatnonzero(drawn)) <= set(np.flatnonzero(want))
    assert 1 < (want > 0).sum() < V  # the truncation kept some, not all
    assert 0.5 * np.abs(drawn - want).sum() < 0.05


@pytest.mark.parametrize("fields,field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("nan")},
                                                      "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"min_p": -0.1}, "min_p"),
    ({"logit_bias": {3: 101}}, "logit_bias.3"), ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {i: 1 for i in range(301)}}, "logit_bias"), ({"logprobs": 21}, "logprobs"),
    ({"thinking_budget": 3}, "thinking_budget"), ({"temperature": float("inf")}, "temperature"),
])
def test_out_of_range_parameters_name_their_field(fields, field):
    with pytest.raises(SamplingError, match=f"'{field}'") as e:
        SamplingParams(**fields)
    assert e.value.field == field
    with pytest.raises(SamplingError, match="outside the vocabulary"):
        SamplingParams(logit_bias={300: 1.0}).check_vocab(256)


# ---------------------------------------------------------------------------------------------
# Through the engine: the step's sampling against numpy over Engine.logits


PROMPT = np.random.RandomState(8).randint(3, 256, 6).tolist()  # greedy repeats a token
NEW = 8  # prompt and output in one page and one scoring length: few shapes to compile


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    path = tiny_checkpoint("deepseek_v3", "qlora_groups", seed=5)
    return tidejax.load(path, engine={"lanes": 3, "max_context": 64, "page_size": 32})


def reference(engine, params: SamplingParams, n: int = NEW) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decoding by full forwards with numpy's processing: the tokens and each step's
    processed logits."""
    vocab = engine.cfg.vocab_size
    counts, seen = np.zeros(vocab, np.int32), np.zeros(vocab, bool)
    seen[PROMPT] = True
    ids, processed = [], []
    for _ in range(n):
        x = np_process(engine.logits(PROMPT + ids)[-1], params, counts, seen)
        token = int(np.argmax(x))
        ids.append(token)
        processed.append(x)
        counts[token] += 1
        seen[token] = True
    return ids, processed


def requests(*params: SamplingParams) -> list[GenerationRequest]:
    return [GenerationRequest(PROMPT, NEW, p, ignore_eos=True) for p in params]


def test_penalties_and_bias_change_greedy_output_as_numpy_predicts(engine):
    plain, processed = reference(engine, SamplingParams())
    second_best = int(np.argsort(-processed[0])[1])
    cases = [SamplingParams(presence_penalty=1.5, frequency_penalty=1.0),
             SamplingParams(repetition_penalty=3.0),
             SamplingParams(logit_bias={plain[0]: -100.0})]
    events = run(engine, requests(*cases))
    for params, got in zip(cases, events):
        want = reference(engine, params)[0]
        assert tokens_of(got) == want
        assert want != plain  # the parameter changed the output
    assert tokens_of(events[2])[0] == second_best
    least = int(np.argmin(processed[0]))
    [forced] = run(engine, requests(SamplingParams(logit_bias={least: 100.0})))
    assert tokens_of(forced) == [least] * NEW


def test_logprobs_are_those_of_the_processed_logits(engine):
    greedy = SamplingParams(presence_penalty=0.5, logprobs=5)
    sampled = SamplingParams(temperature=1.0, min_p=0.05, seed=3, logprobs=2)
    events = run(engine, requests(greedy, sampled, SamplingParams()))
    tokens, processed = reference(engine, greedy)
    got = [e for e in events[0] if isinstance(e, TokenEvent)]
    assert [e.token_id for e in got] == tokens
    for event, x in zip(got, processed):
        logp = np_log_softmax(x)
        assert event.logprob == pytest.approx(logp[event.token_id], abs=2e-4)
        top = np.argsort(-logp)[:5]
        assert [t for t, _ in event.top] == top.tolist()
        np.testing.assert_allclose([lp for _, lp in event.top], logp[top], atol=2e-4)
    drawn = [e for e in events[1] if isinstance(e, TokenEvent)]
    assert len(drawn) == NEW and all(len(e.top) == 2 for e in drawn)
    vocab = engine.cfg.vocab_size
    counts, seen = np.zeros(vocab, np.int32), np.zeros(vocab, bool)
    for i, event in enumerate(drawn):  # each draw allowed by min_p, its logprob numpy's
        x = np_process(engine.logits(PROMPT + [e.token_id for e in drawn[:i]])[-1], sampled,
                       counts, seen)
        assert np_kept(x, sampled)[event.token_id] > 0
        assert event.logprob == pytest.approx(np_log_softmax(x)[event.token_id], abs=2e-4)
    assert all(e.logprob is None for e in events[2] if isinstance(e, TokenEvent))


def test_thinking_budget_forces_the_end_token(engine):
    plain = reference(engine, SamplingParams())[0]
    end = next(t for t in range(3, 256) if t not in plain)
    params = SamplingParams(thinking_budget=3, thinking_end=end)
    [got] = run(engine, requests(params))
    assert tokens_of(got)[:4] == plain[:3] + [end]
    assert tokens_of(got) == reference(engine, params)[0]


def test_one_compiled_step_serves_every_mix(engine):
    """The same schedule all greedy, then with every parameter mixed across the lanes: nothing
    compiles again."""
    run(engine, requests(SamplingParams(), SamplingParams(), SamplingParams()))
    steps = engine.loaded.steps
    compiled = (steps.step.jitted._cache_size(), steps.set_lane._cache_size())
    run(engine, requests(
        SamplingParams(temperature=0.8, top_k=5, min_p=0.1, seed=1, logprobs=4),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=2.0, repetition_penalty=1.4,
                       logit_bias={3: 5.0, 4: -5.0}),
        SamplingParams(thinking_budget=2, thinking_end=9, logprobs=0)))
    assert (steps.step.jitted._cache_size(), steps.set_lane._cache_size()) == compiled
