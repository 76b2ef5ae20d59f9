"""DeepSeek-V4.1 through the engine (lanes, residency, scheduler) and the server, on tiny_a."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tidejax
from tidejax.runtime.scheduler import GenerationRequest, TokenEvent
from tests.support.server_fixtures import REPO, live_server

GOLDEN = Path(__file__).parents[1] / "data" / "golden_v41" / "tiny_a"


@pytest.fixture(scope="module")
def engine():
    return tidejax.load(GOLDEN, engine={"lanes": 2, "max_context": 128, "prefill_chunk": 16})


def test_logits_and_half_resident_exact(engine):
    ids = np.load(GOLDEN / "input_ids.npy")[0]
    want = np.load(GOLDEN / "logits.npy")
    full = engine.logits(ids)
    assert np.abs(full - want).max() <= 1e-4
    n_layers, n_experts = engine.family.expert_dims(engine.cfg)[:2]
    half = tidejax.load(GOLDEN, residency={"budget_experts": n_layers * n_experts // 2,
                                           "miss_policy": "exact"})
    np.testing.assert_array_equal(half.logits(ids), full)
    assert half.residency.stats()["misses"] > 0


def test_greedy_through_lanes_equals_golden(engine):
    """Prefill in 16-token chunks, then decode on 2 lanes with another request beside it,
    pipelined: each iteration leaves its step in flight (queued before the previous one's
    tokens were read, its input tokens and Engram hashes taken on the device), and the tokens
    are the golden greedy ones, which tests/models/test_deepseek_v41.py gets by feeding every token
    from the host."""
    ids = np.load(GOLDEN / "input_ids.npy")[0]
    greedy = np.load(GOLDEN / "greedy.npy").tolist()
    outputs = {0: [], 1: []}
    for lane, prompt in enumerate([ids[:16], ids[20:40]]):
        engine.scheduler.submit(
            GenerationRequest(prompt.tolist(), len(greedy), ignore_eos=True),
            lambda e, lane=lane: outputs[lane].append(e.token_id) if isinstance(e, TokenEvent) else None)
    in_flight = []
    while engine.scheduler.step():
        in_flight.append(engine.scheduler._in_flight is not None)
    assert sum(in_flight) >= len(greedy), in_flight
    assert outputs[0] == greedy
    assert len(outputs[1]) == len(greedy)


def test_prompt_chunks_beside_a_decoding_lane_equal_each_alone(engine):
    """A 44-token prompt arrives while the golden request decodes: its three 16-token chunks run
    in the decoding lane's steps (on its own lane's cache rows), and both requests get the tokens
    they get alone."""
    ids = np.load(GOLDEN / "input_ids.npy")[0]
    greedy = np.load(GOLDEN / "greedy.npy").tolist()
    late = ids[20:64].tolist()
    alone = []
    engine.scheduler.submit(GenerationRequest(late, 8, ignore_eos=True),
                            lambda e: alone.append(e.token_id) if isinstance(e, TokenEvent) else None)
    engine.scheduler.run_until_idle()
    outputs = {0: [], 1: []}
    engine.scheduler.submit(GenerationRequest(ids[:16].tolist(), len(greedy), ignore_eos=True),
                            lambda e: outputs[0].append(e.token_id) if isinstance(e, TokenEvent) else None)
    for _ in range(3):
        engine.scheduler.step()
    during = len(outputs[0])
    engine.scheduler.submit(GenerationRequest(late, 8, ignore_eos=True),
                            lambda e: outputs[1].append(e.token_id) if isinstance(e, TokenEvent) else None)
    for _ in range(3):  # the prompt's three chunks, one a step
        engine.scheduler.step()
    assert len(outputs[0]) == during + 3  # the decoding lane got a token in each of them
    engine.scheduler.run_until_idle()
    assert outputs[0] == greedy and outputs[1] == alone


def test_tiny_profile_serves_through_the_openai_api(tmp_path):
    from openai import OpenAI
    profile = tmp_path / "ds41.toml"
    profile.write_text((REPO / "configs" / "ds41-tiny.toml").read_text().replace(
        'path = "tests/data/golden_v41/tiny_a"', f'path = "{GOLDEN}"'))
    with live_server(profile) as url:
        client = OpenAI(base_url=url + "/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["ds41-tiny"]
        out = client.completions.create(model="ds41-tiny", prompt="the cat", max_tokens=8,
                                        temperature=0)
        assert out.usage.completion_tokens > 0 and out.choices[0].text
        stream = client.completions.create(model="ds41-tiny", prompt="the cat", max_tokens=8,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == out.choices[0].text


def test_a_repeated_prompt_restores_its_lane_from_a_snapshot(engine):
    """V4.1's lanes keep window rings, compressor buffers and the Engram look-back beside the
    pool: a 70-token prompt's chunks break at its last full page (64), where the lane's rows are
    read to host memory with the page; the same prompt again matches that page, has the
    snapshot written into its lane and prefills its last 6 tokens, with the first run's tokens."""
    assert engine.lane_bytes() > 0
    assert engine.loaded.prefix_caching and engine.scheduler.caching and engine.scheduler.snapshots
    prompt = np.load(GOLDEN / "input_ids.npy")[0].tolist() + [5, 6, 7, 8, 9, 10]
    runs = []
    for _ in range(2):
        events, before = [], engine.scheduler.totals["prefilled_tokens"]
        engine.scheduler.submit(GenerationRequest(prompt, 8, ignore_eos=True), events.append)
        engine.scheduler.run_until_idle()
        runs.append(([e.token_id for e in events if isinstance(e, TokenEvent)],
                     events[-1].stats["cached_tokens"],
                     engine.scheduler.totals["prefilled_tokens"] - before))
    assert [run[1:] for run in runs] == [(0, 70), (64, 6)]
    assert runs[1][0] == runs[0][0] and len(runs[0][0]) == 8
    assert engine.scheduler.kv_stats()["lane_snapshots"] >= 1
