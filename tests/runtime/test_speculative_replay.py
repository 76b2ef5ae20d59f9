"""Routing replay with speculative decoding (issue 33): the replay keyed by the token (a request's
window plus the token's position, steps.Replay), so a verify step's positions route by the rows
plain steps give them and the greedy output with speculation on is the one with it off under the
same replayed trace; the MTP layer routes by its position's row of the last main MoE layer."""

from __future__ import annotations

import numpy as np
import pytest

import tidejax
from tidejax.runtime.scheduler import GenerationRequest
from tidejax.runtime.steps import Replay
from tests.support.engine_probes import run, tokens_of
from tests.support.tiny_models import repeating_mtp

K = 2  # drafts a lane a step
NEW = 16
# a pool of 8 pages of 8 tokens for four lanes of up to 32: a request is preempted and resumed,
# its tokens keeping their rows; no warm-up (each step compiles when first met)
ENGINE = dict(lanes=4, max_context=32, page_size=8, prefill_chunk=16, kv_pool_tokens=64,
              warmup=False)
PROMPTS = [np.random.RandomState(10 + n).randint(3, 256, n).tolist() for n in (13, 7, 10, 5)]
ROWS = 61  # the trace's rows: fewer than the windows span, so windows wrap


def trace(n_moe: int, n_experts: int, k: int) -> np.ndarray:
    """[ROWS, n_moe, k] distinct random picks a row and layer, but the last MoE layer's, which
    are the top k experts in every row: the MTP layer's picks, taken from that row, hit only
    those."""
    rng = np.random.RandomState(7)
    picks = np.stack([rng.choice(n_experts, k, replace=False) for _ in range(ROWS * n_moe)])
    picks = picks.reshape(ROWS, n_moe, k)
    picks[:, -1] = np.arange(n_experts - k, n_experts)
    return picks


@pytest.fixture(scope="module")
def checkpoints(v3_mtp, tiny_checkpoint, tmp_path_factory) -> dict:
    """Tiny checkpoints whose MTP layer drafts well (tiny_models.repeating_mtp) by family:
    DeepSeek-V3, GLM-4.5 and GLM-5 (its layer 0 with an indexer, layer 1 reusing its pick)."""
    def drafting(family, config, seed):
        return repeating_mtp(tiny_checkpoint(family, config, seed=seed),
                             tmp_path_factory.mktemp(f"{family}-mtp") / "mtp", 0.3)
    return {"deepseek_v3": v3_mtp, "glm4_moe": drafting("glm4_moe", "qknorm_groups", 0),
            "glm_moe_dsa": drafting("glm_moe_dsa", "topk_below", 5)}


def greedy(engine, prompts, picks):
    """Each prompt's NEW greedy tokens under the replay of `picks`, all submitted at once, and
    their stats."""
    engine.set_routing_replay(picks)
    events = run(engine, [GenerationRequest(p, NEW, ignore_eos=True) for p in prompts])
    return [tokens_of(got) for got in events], [got[-1].stats for got in events]


def test_replay_keys_rows_by_window_and_position():
    """Row (window + p) mod N for the token at p, the MTP layer's the last MoE layer's of it."""
    picks = np.arange(5 * 3 * 2).reshape(5, 3, 2)
    replay = Replay(picks, np.array([0, 4]))
    positions = np.array([[0, 1, 2], [3, 4, 5]])
    rows = np.array([[0, 1, 2], [2, 3, 4]])
    np.testing.assert_array_equal(replay.ids(positions), picks[rows])
    np.testing.assert_array_equal(replay.mtp_ids(positions), picks[rows, -1])
    np.testing.assert_array_equal(replay.row(1).ids(positions[1:]), picks[rows[1:]])


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "glm_moe_dsa"])
def test_greedy_output_under_replay_is_speculation_offs(family, checkpoints):
    """One request alone, then four in a pool that preempts: under one replayed trace, the
    greedy tokens with speculation on are those with it off, token for token (and not those
    of the trace with its experts relabelled: the replay routes them); drafts were accepted;
    the MTP layer routed by the last main MoE layer's row (its counts only on that layer's
    experts). Rows that move on with the steps, as the slot-keyed replay's did, change V3's
    tokens with speculation on but not GLM-4.5's or GLM-5's (their tiny models' tokens follow a
    change of the experts, not one of the rows a token): V3's run is the check that rows follow
    tokens."""
    path = checkpoints[family]
    plain = tidejax.load(path, engine=ENGINE, residency={"drain_every": 1000})
    speculating = tidejax.load(path, engine=ENGINE, residency={"drain_every": 1000},
                               speculative={"method": "mtp", "tokens": K})
    n_moe, n_experts = plain.family.expert_dims(plain.cfg)[:2]
    k = plain.cfg.num_experts_per_tok
    picks = trace(n_moe, n_experts, k)
    for prompts in (PROMPTS[:1], PROMPTS):
        want = greedy(plain, prompts, picks)[0]
        got, stats = greedy(speculating, prompts, picks)
        print(f"{family}: accepted {[s['accepted_tokens'] for s in stats]} of "
              f"{[s['drafted_tokens'] for s in stats]} drafts")
        assert got == want
        assert sum(s["accepted_tokens"] for s in stats) > 0
    other = np.random.RandomState(3).permutation(n_experts)[picks]  # the experts relabelled
    assert want != greedy(plain, PROMPTS, other)[0]  # the trace routes them
    assert speculating.scheduler.totals["preemptions"] > 0
    mtp_counts = np.asarray(speculating.state.experts.counts)[n_moe]
    assert mtp_counts[n_experts - k:].sum() > 0 and not mtp_counts[:n_experts - k].any()
