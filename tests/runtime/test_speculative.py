"""Speculative decoding (issue 33): the [speculative] profile table and its start-up checks, and
the acceptance rules (runtime/speculative.py): greedy prefixes, and rejection sampling that keeps
the target distribution exactly."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2

from tidejax.config import EngineConfig
from tidejax.errors import ConfigError
from tidejax.runtime.build import LoadedModel, put_mtp_rows
from tidejax.runtime.sampling import (LaneParams, LaneSampling, SamplingParams, lane_keys,
                                      probabilities, process, sample)
from tidejax.runtime.speculative import accept, draw
from tidejax.kv.paged import PagedCache
from tidejax.models.deepseek_v3.config import DeepseekV3Config
from tidejax.models.deepseek_v3.model import build, build_mtp
from tidejax.models.deepseek_v3.weights import load_weights
from tidejax.models.layers.mla import MLACache
from tidejax.models.layers.mtp import mtp_params, with_mtp_slots
from tidejax.models.loading import ExpertPool
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import all_resident_state
from tidejax.runtime.speculative import Speculator
from tests.support.tiny_models import repeating_mtp, write_mtp_copy


def profile(path, **speculative) -> EngineConfig:
    return EngineConfig.from_dict({"model": {"path": str(path)}, "speculative": speculative},
                                  source="spec.toml")


def test_speculative_table_defaults_and_ranges():
    """Off by default; method is a choice, tokens 1..4, each failing naming the key."""
    assert EngineConfig().speculative.method == "none"
    assert EngineConfig().speculative.tokens == 1
    assert profile("x", method="mtp", tokens=4).speculative.tokens == 4
    with pytest.raises(ConfigError, match=r"spec.toml: 'speculative.method' = 'eagle' is not one"):
        profile("x", method="eagle")
    for k in (0, 5):
        with pytest.raises(ConfigError, match=rf"'speculative.tokens' = {k} should be"):
            profile("x", tokens=k)
    with pytest.raises(ConfigError, match=r"unknown key 'speculative.depth'"):
        profile("x", depth=2)


def test_mtp_refused_at_start_naming_what_is_missing(tiny_checkpoint, tmp_path):
    """method = "mtp" on a checkpoint without an MTP layer (none counted, or one counted whose
    tensors it lacks) names config.json's field; on a family without an MTP draft forward names
    the family; a checkpoint that has one loads with k drafts a lane and the MTP layer's slot in
    the pool's bytes a token."""
    plain = tiny_checkpoint("deepseek_v3", "qlora_groups")
    with pytest.raises(ConfigError, match=r"spec.toml: 'speculative.method' = 'mtp' but "
                                          r".*config.json has no MTP layer .*"
                                          r"'num_nextn_predict_layers'"):
        LoadedModel(profile(plain, method="mtp"))
    with pytest.raises(ConfigError, match=r"the mixtral family has no MTP draft forward"):
        LoadedModel(profile(tiny_checkpoint("mixtral", "top2"), method="mtp"))
    # a count of MTP layers whose tensors the checkpoint lacks (an export that dropped them)
    counted = tmp_path / "counted"
    shutil.copytree(plain, counted)
    raw = json.loads((counted / "config.json").read_text())
    (counted / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 1}))
    assert LoadedModel(profile(counted)).speculating == 0
    with pytest.raises(ConfigError, match=r"holds no MTP layer \(config.json's field "
                                          r"'num_nextn_predict_layers' = 1"):
        LoadedModel(profile(counted, method="mtp"))
    with_mtp = tmp_path / "mtp"
    write_mtp_copy(plain, with_mtp, attention_from=0, moe_from=1)
    plain, speculating = LoadedModel(profile(with_mtp)), LoadedModel(profile(with_mtp, method="mtp",
                                                                              tokens=3))
    assert (plain.speculating, speculating.speculating) == (0, 3)
    layers = plain.cfg.num_layers
    assert speculating.cache_bytes_per_token() * layers == plain.cache_bytes_per_token() * (
        layers + 1)


# ---------------------------------------------------------------------------------------------
# The acceptance rule, on a tiny vocabulary

TRIALS = 20000  # lanes, each an independent trial with its own seed
VOCAB = 8
# every sampling parameter the server takes (thinking budget aside: it forces one token)
SAMPLED = dict(temperature=0.8, top_k=6, top_p=0.95, min_p=0.03, presence_penalty=0.5,
               frequency_penalty=0.3, repetition_penalty=1.3, logit_bias=((2, 1.0),))
# a chi-square bound with a one-in-10^4 false alarm for a correct sampler (the seeds are fixed,
# so a run that passes passes every time)
ALARM = 1e-4


def lanes(params: SamplingParams, trials: int = TRIALS) -> LaneSampling:
    """`trials` lanes with `params` and seeds 0..trials-1, which have generated tokens 1, 1, 3
    and seen 0 in the prompt (so the penalties move the logits)."""
    rows = LaneParams.of([dataclasses.replace(params, seed=i) for i in range(trials)])
    counts = np.zeros((trials, VOCAB), np.int32)
    counts[:, 1], counts[:, 3] = 2, 1
    seen = counts > 0
    seen[:, 0] = True
    return jax.tree.map(jnp.asarray, LaneSampling(rows, counts, seen))


def distributions(logits, sampling: LaneSampling):
    """logits [n, v] (one lane's at n positions) -> [trials, n, v]: each position's distribution
    after the penalties, bias, temperature and truncation, the same for every lane."""
    rows = [probabilities(process(jnp.broadcast_to(row, (TRIALS, VOCAB)), sampling),
                          sampling.params) for row in logits]
    return jnp.stack(rows, axis=1)


def chi_square(tokens, expected) -> float:
    """Pearson's statistic of tokens [m] against expected [v] (numpy) over the bound for the
    tokens that can be drawn (inf where a token of probability 0 was drawn)."""
    counts = np.bincount(tokens, minlength=VOCAB)
    if counts[expected == 0].sum():
        print(f"tokens of probability 0 drawn: {counts} against {expected}")
        return np.inf
    live = expected > 0
    want = expected[live] * len(tokens)
    stat = float(((counts[live] - want) ** 2 / want).sum())
    bound = chi2.ppf(1 - ALARM, live.sum() - 1)
    print(f"chi-square {stat:.1f} (bound {bound:.1f}, {live.sum()} tokens, {len(tokens)} draws)")
    return stat / bound  # below 1: within the bound


@pytest.fixture(scope="module")
def sampled_verdict():
    """k = 2 drafts from a draft model unlike the target, verified over TRIALS lanes:
    (target distributions [3, v], drafts [trials, 2], Verdict)."""
    rng = np.random.RandomState(3)
    target = jnp.asarray(rng.randn(3, VOCAB).astype(np.float32) * 1.5)
    draft = target[:2] + jnp.asarray(rng.randn(2, VOCAB).astype(np.float32))
    sampling = lanes(SamplingParams(**SAMPLED))
    p, q = distributions(target, sampling), distributions(draft, sampling)
    keys = lane_keys(sampling.params.seed, jnp.full(TRIALS, 10))
    draft_keys = jax.vmap(lambda key: jax.random.split(key, 3))(
        lane_keys(sampling.params.seed, jnp.full(TRIALS, 11)))
    drafts = jnp.stack([draw(q[:, i], draft_keys[:, i]) for i in range(2)], axis=1)
    verdict = jax.jit(accept)(p, q, drafts, keys)
    return np.asarray(p[0]), np.asarray(drafts), jax.tree.map(np.asarray, verdict), sampling, target


def test_rejection_sampling_keeps_the_target_distribution(sampled_verdict):
    """Each emitted token follows the target's distribution (penalties, bias, temperature, top_k,
    top_p, min_p applied) within the chi-square bound, as the non-speculative sampler's tokens
    do over the same seeds; the draft's own tokens, taken as they are, do not."""
    p, drafts, verdict, sampling, target = sampled_verdict
    accepted, tokens = verdict.accepted, verdict.tokens
    assert 0 < (accepted > 0).mean() < 1 and (accepted == 2).any()  # both branches taken
    assert chi_square(tokens[:, 0], p[0]) < 1
    # the token at position i, where the step emits it, follows p_i (the target's distributions
    # here do not depend on the tokens before, so the events before it are independent of it)
    assert chi_square(tokens[accepted >= 1, 1], p[1]) < 1
    assert chi_square(tokens[accepted == 2, 2], p[2]) < 1
    plain = sample(jnp.broadcast_to(target[0], (TRIALS, VOCAB)), sampling, jnp.full(TRIALS, 10))
    assert chi_square(np.asarray(plain.tokens), p[0]) < 1
    assert chi_square(drafts[:, 0], p[0]) > 1  # the bound has the power to tell them apart


def test_drafts_not_live_are_neither_kept_nor_subtracted():
    """Drafts marked not live (a lane without current drafts) are rejected whatever the keys,
    and the step's token follows the target's p itself, not the residual max(0, p - q)."""
    rng = np.random.RandomState(7)
    target = jnp.asarray(rng.randn(2, VOCAB).astype(np.float32) * 1.5)
    sampling = lanes(SamplingParams(**SAMPLED))
    p = distributions(jnp.concatenate([target, target[:1]]), sampling)
    q = distributions(target + jnp.asarray(rng.randn(2, VOCAB).astype(np.float32)), sampling)
    keys = lane_keys(sampling.params.seed, jnp.full(TRIALS, 4))
    drafts = jnp.stack([draw(q[:, i], jax.random.split(keys[0], TRIALS)) for i in range(2)], 1)
    verdict = jax.jit(accept)(p, q, drafts, keys, jnp.zeros((TRIALS, 2), bool))
    assert (np.asarray(verdict.accepted) == 0).all()
    p0, q0 = np.asarray(p[0, 0]), np.asarray(q[0, 0])
    assert chi_square(np.asarray(verdict.tokens[:, 0]), p0) < 1
    residual = np.maximum(p0 - q0, 0)
    assert chi_square(np.asarray(verdict.tokens[:, 0]), residual / residual.sum()) > 1


def test_greedy_acceptance_is_the_longest_matching_prefix():
    """Greedy lanes (p, q one-hot): the drafts kept are the longest prefix equal to the target's
    argmax, and the step's token is the target's argmax after them, whatever the keys."""
    rng = np.random.RandomState(5)
    b, k = 64, 3
    target = rng.randn(b, k + 1, VOCAB).astype(np.float32)
    best = target.argmax(-1)  # [b, k + 1]
    # drafts agreeing with the target for a random number of leading positions, then not
    agree = rng.randint(0, k + 1, b)
    drafts = np.where(np.arange(k)[None] < agree[:, None], best[:, :k], (best[:, :k] + 1) % VOCAB)
    greedy = LaneParams.of([SamplingParams()] * b)
    p = jnp.stack([probabilities(jnp.asarray(target[:, i]), greedy) for i in range(k + 1)], 1)
    q = jax.nn.one_hot(drafts, VOCAB)
    verdict = accept(p, q, jnp.asarray(drafts, jnp.int32), lane_keys(jnp.arange(b), jnp.zeros(b, int)))
    np.testing.assert_array_equal(verdict.accepted, agree)
    for lane in range(b):
        n = agree[lane]
        np.testing.assert_array_equal(verdict.tokens[lane, :n + 1], best[lane, :n + 1])
        assert (np.asarray(verdict.tokens[lane, n + 1:]) == 0).all()


# ---------------------------------------------------------------------------------------------
# Verify rounds over a tiny DeepSeek-V3 with one MTP layer (the model alone; the engine does not
# run them yet)

SERVE = ServeOptions(kernel="reference", all_resident=True)
PAGE = 4
PROMPT = [5, 9, 17, 33, 2, 60, 7]
NEW = 20  # greedy tokens compared
# four lanes' prompts, of two lengths (the first alone is the one-lane case)
ROWS = [PROMPT, PROMPT[::-1], [t + 1 for t in PROMPT], PROMPT[:5]]
SCALE = 0.3  # repeating_mtp's: its greedy output repeats for runs and leaves them (both paths)


@pytest.fixture(scope="module")
def mtp_models(tiny_checkpoint, tmp_path_factory):
    """{"random": random MTP weights, "repeating": repeating_mtp's} -> (cfg, params, experts:
    the main MoE layers' and the MTP layer's after them, as the engine's pool holds them, MTP
    params, plain greedy output of each of ROWS), on one base checkpoint."""
    base = tiny_checkpoint("deepseek_v3", "qlora_groups")
    folder = tmp_path_factory.mktemp("spec")
    out = {}
    for name in ("random", "repeating"):
        path = folder / name
        if name == "random":
            write_mtp_copy(base, path, attention_from=0, moe_from=1)
        else:
            repeating_mtp(base, path, SCALE)
        raw = json.loads((path / "config.json").read_text())
        cfg = DeepseekV3Config.from_hf(raw)
        layers = len(cfg.moe_layers) + 1
        pool = ExpertPool(layers * cfg.n_routed_experts, "checkpoint", np.float32)
        params, kept = load_weights(cfg, path, raw, SERVE, jnp.float32, pool.put_row)
        put_mtp_rows(cfg, kept, pool.put_row, np.float32, raw)
        out[name] = (cfg, params, all_resident_state(pool.result(), layers),
                     mtp_params(params, kept, cfg, jnp.float32))
    return {name: (*model, plain_greedy(model, ROWS)) for name, model in out.items()}


@functools.cache
def jitted(cfg, k: int):
    """(Speculator, its prefill forward, draft and verify, jitted) for `cfg` and k: the models
    share their config, so every test's calls of a shape compile once."""
    spec = Speculator(build(cfg, SERVE, jnp.float32), build_mtp(cfg, SERVE, jnp.float32), k)
    prefill = jax.jit(lambda params, *a: spec.main.apply({"params": params}, *a,
                                                         mutable=["intermediates"]))
    return spec, prefill, jax.jit(spec.draft), jax.jit(spec.verify)


def greedy_lanes(b: int, vocab: int) -> LaneSampling:
    return jax.tree.map(jnp.asarray, LaneSampling.create(b, vocab))


def pool(cfg, rows: int):
    """A fresh pool with the MTP slot and shuffled block tables [rows, P] covering everything."""
    pages = (len(PROMPT) + NEW + 8 + PAGE) // PAGE
    cache = PagedCache(MLACache.create(with_mtp_slots(cfg), rows * pages, PAGE, jnp.float32))
    table = np.random.RandomState(0).permutation(rows * pages).reshape(rows, pages)
    return cache, jnp.asarray(table.astype(np.int32))


def padded(prompts):
    """Prompts -> (tokens [b, T] padded with 0, positions [b, T], mask [b, T], lengths [b])."""
    lengths = np.array([len(p) for p in prompts])
    tokens = np.zeros((len(prompts), lengths.max()), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
    positions = np.broadcast_to(np.arange(lengths.max()), tokens.shape)
    return (jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(positions < lengths[:, None]),
            lengths)


def plain_greedy(model, prompts) -> list[list[int]]:
    """One token a step for every row through the main model."""
    cfg, params, experts = model[:3]
    main = jax.jit(lambda *a, at=None: build(cfg, SERVE, jnp.float32).apply(
        {"params": params}, *a, logits_at=at))
    cache, table = pool(cfg, len(prompts))
    tokens, positions, mask, lengths = padded(prompts)
    logits, cache, experts = main(tokens, positions, mask, cache, table, experts,
                                  at=jnp.asarray(lengths - 1))
    out = [logits[:, 0].argmax(-1)]
    positions = jnp.asarray(lengths)[:, None]
    while len(out) < NEW:
        logits, cache, experts = main(out[-1][:, None], positions, positions > -1, cache, table,
                                      experts)
        out.append(logits[:, 0].argmax(-1))
        positions = positions + 1
    return np.stack(out, 1).tolist()


def speculative_greedy(model, k: int, prompts) -> tuple[list[list[int]], int, int, int]:
    """Every row's prompt, a first draft, then verify rounds over all rows together until each
    row has NEW tokens -> (each row's tokens, rounds, drafts accepted in all, rows' rounds that
    rejected a draft)."""
    cfg, params, experts, mparams = model[:4]
    spec, prefill, draft, verify = jitted(cfg, k)
    b = len(prompts)
    cache, table = pool(cfg, b)
    tokens, positions, mask, lengths = padded(prompts)
    (logits, cache, experts), seen = prefill(params, tokens, positions, mask, cache, table,
                                             experts)
    at = jnp.asarray(lengths - 1)
    first = logits[jnp.arange(b), at].argmax(-1)
    out = [[int(t)] for t in first]
    following = jnp.where(positions == at[:, None], first[:, None], jnp.roll(tokens, -1, 1))
    keys = lane_keys(jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32))
    sampling = greedy_lanes(b, cfg.vocab_size)
    drafts, q, cache, experts = draft(
        mparams, seen["intermediates"]["head_hidden"][0], following, positions, mask, at, cache,
        table, experts, sampling, keys)
    rounds = accepted = rejecting = 0
    while min(len(row) for row in out) < NEW:
        tokens = jnp.concatenate([jnp.asarray([[row[-1]] for row in out]), drafts], 1)
        starts = np.array([n + len(row) - 1 for n, row in zip(lengths, out)])
        verdict, _, drafts, q, cache, experts, sampling = verify(
            params, mparams, tokens, jnp.asarray(starts[:, None] + np.arange(k + 1)),
            tokens > -1, q, cache, table, experts, sampling, keys)
        for row, a in enumerate(np.asarray(verdict.accepted)):
            out[row] += [int(t) for t in verdict.tokens[row, :a + 1]]
            accepted, rejecting = accepted + int(a), rejecting + int(a < k)
        rounds += 1
    return [row[:NEW] for row in out], rounds, accepted, rejecting


@pytest.mark.parametrize("lanes, k", [(1, 1), (1, 3), (4, 1), (4, 3)])
def test_verify_rounds_decode_what_greedy_decodes(mtp_models, k, lanes):
    """Greedy output is token for token the one-token-a-step decode's, at 1 and 4 lanes (each
    lane accepting its own number of drafts), with random MTP weights (drafts rejected: the
    rollback path) and with the repeating MTP layer, where drafts are accepted and a lane's
    decode takes fewer rounds than tokens."""
    for name, model in mtp_models.items():
        want = model[-1][:lanes]
        got, rounds, accepted, rejecting = speculative_greedy(model, k, ROWS[:lanes])
        print(f"{name} k={k} lanes={lanes}: {rounds} rounds for {NEW} tokens a lane, "
              f"{accepted} drafts accepted, {rejecting} lane rounds rejecting one")
        assert got == want, name
        assert rejecting > 0
        if name == "repeating":
            assert accepted > 0
            if lanes == 1:  # (with more, the lane accepting least sets the rounds)
                assert rounds < NEW - 1


def test_verify_round_picks_are_counted_as_demand(mtp_models):
    """The verify round's k + 1 positions a row go through the MoE layers' demand counting like
    any step's tokens: each main MoE layer's wanted picks grow by (k + 1) x top_k, a one-token
    step's by top_k; the MTP layer's (the state's last layer) by its draft positions' picks:
    the kept positions, then the chain's k - 1."""
    cfg, params, experts, mparams = mtp_models["random"][:4]
    k = 3
    _, prefill, _, verify = jitted(cfg, k)
    cache, table = pool(cfg, 1)
    tokens = jnp.asarray([PROMPT[:k + 1]])
    q = jax.nn.one_hot(tokens[:, 1:], cfg.vocab_size)
    keys = lane_keys(jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
    before = np.asarray(experts.counts).sum(axis=1)  # [L_moe + 1]
    verdict, _, _, _, _, after, _ = verify(
        params, mparams, tokens, jnp.arange(k + 1)[None], tokens > -1, q, cache, table, experts,
        greedy_lanes(1, cfg.vocab_size), keys)
    added = np.asarray(after.counts).sum(axis=1) - before
    np.testing.assert_allclose(added[:-1], (k + 1) * cfg.num_experts_per_tok)
    kept = int(verdict.accepted[0]) + 1
    np.testing.assert_allclose(added[-1], (kept + k - 1) * cfg.num_experts_per_tok)
    one = jnp.asarray([PROMPT[:1]])
    (_, _, single), _ = prefill(params, one, jnp.zeros((1, 1), jnp.int32), one > -1, cache,
                                table, experts)
    added = np.asarray(single.counts).sum(axis=1) - before
    np.testing.assert_allclose(added[:-1], cfg.num_experts_per_tok)
    assert added[-1] == 0  # the main model alone: the MTP layer routes nothing


def test_sampled_verify_rounds_complete_and_accept(mtp_models):
    """Sampled rounds (temperature, top_p and the penalties, each position's p and each draft's
    q with the tokens before it counted) on the repeating MTP layer run to the end, accepting
    drafts; the lane's token counts afterwards are those of the tokens emitted; the same seed
    gives the same tokens."""
    cfg, params, experts, mparams = mtp_models["repeating"][:4]
    k = 3  # the shapes the greedy tests compiled
    lane = LaneParams.of([SamplingParams(temperature=0.5, top_p=0.9, seed=3, min_p=0.01,
                                         frequency_penalty=0.4, presence_penalty=0.2,
                                         repetition_penalty=1.1)])
    verify = jitted(cfg, k)[3]

    def run():
        cache, table = pool(cfg, 1)
        sampling = dataclasses.replace(greedy_lanes(1, cfg.vocab_size),
                                       params=jax.tree.map(jnp.asarray, lane))
        tokens = jnp.asarray([PROMPT[-1:] + PROMPT[:k]])
        q = jax.nn.one_hot(tokens[:, 1:], cfg.vocab_size)
        out, accepted, position = [PROMPT[-1]], 0, len(PROMPT) - 1
        state = experts
        while len(out) < 16:
            keys = lane_keys(jnp.asarray([3]), jnp.asarray([position]))
            verdict, _, drafts, q, cache, state, sampling = verify(
                params, mparams, tokens, position + jnp.arange(k + 1)[None], tokens > -1, q,
                cache, table, state, sampling, keys)
            a = int(verdict.accepted[0])
            out += [int(t) for t in verdict.tokens[0, :a + 1]]
            accepted, position = accepted + a, position + a + 1
            tokens = jnp.concatenate([jnp.asarray([[out[-1]]]), drafts], 1)
        # counted: every token emitted but the last (the next round's input)
        np.testing.assert_array_equal(np.asarray(sampling.counts[0]),
                                      np.bincount(out[:-1], minlength=cfg.vocab_size))
        return out, accepted

    out, accepted = run()
    print(f"sampled: {out}, {accepted} drafts accepted")
    assert accepted > 0
    assert run() == (out, accepted)
