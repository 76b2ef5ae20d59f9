"""Routing traces (residency/trace.py): an engine serving a few requests with tracing on records
the picks it counted (per layer and expert, the demand history it drained; its misses; its
wanted picks), and the recorder samples, bounds its files and keeps one engine's trace apart
from another's."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import tidejax
from tidejax.errors import ConfigError
from tidejax.residency.state import Picks
from tidejax.residency.trace import TraceRecorder, chunk_files, read_trace
from tests.support.server_fixtures import write_chat_model
from tests.support.traces import PROMPTS, check_trace_is_what_was_counted, traced

L, K, E = 2, 3, 8  # the recorder tests' geometry
HEADER = {"model": "toy", "model_type": "none", "n_layers": L, "n_experts": E, "top_k": K}


def test_an_engine_traces_the_picks_it_counts(tmp_path):
    state_dir = tmp_path / "state"
    engine = tidejax.load(write_chat_model(tmp_path / "tiny"), **traced(state_dir))
    for prompt in PROMPTS:
        engine.generate(prompt, max_new_tokens=5)
    stats = engine.residency.stats()
    engine.close()
    trace = check_trace_is_what_was_counted(state_dir, stats)
    header, weights = trace["header"], trace["weights"]
    assert header["model"] == "tiny" and header["model_type"] == "deepseek_v3"
    assert (header["n_layers"], header["n_experts"], header["top_k"]) == (1, E, K)
    assert header["resident_slots"] == 4 and header["residency"]["miss_policy"] == "substitute"
    # the router's order, best first (this checkpoint's correction bias is zero)
    assert (np.diff(weights, axis=-1) <= 0).all()


def step_picks(step: int, tokens: int) -> Picks:
    """A step's Picks as serve_routed writes them: `tokens` real rows of every layer (ids and
    weights a function of the step), two padding rows after them."""
    picks = Picks.empty(16, L, K)
    for layer in range(L):
        ids = (np.arange(tokens * K).reshape(tokens, K) + step + layer) % E
        ids = np.concatenate([ids, np.zeros((2, K), int)])
        weights = np.full(ids.shape, 1.0 / (step + 1), np.float32)
        live = np.arange(len(ids)) < tokens
        picks = picks.write(layer, jnp.asarray(ids, jnp.int32), jnp.asarray(weights),
                            jnp.asarray(ids % 2 == 0), jnp.asarray(live))
    return picks.advanced(len(ids))


def feed(folder, steps: int, every: int, max_bytes: int, start: int = 0) -> None:
    recorder = TraceRecorder(folder, HEADER, every, max_bytes)
    for step in range(start, steps):
        recorder.after_step(step, step_picks(step, 1 + step % 5), version=step // 4)
    recorder.close()


def test_the_recorder_samples_and_reads_back(tmp_path):
    feed(tmp_path / "routing", steps=20, every=3, max_bytes=1 << 20)
    header, trace = read_trace(tmp_path / "routing")
    assert header == {**HEADER, "format": "tidejax-routing-trace", "version": 1,
                      "trace_every_steps": 3}
    sampled = list(range(0, 20, 3))
    assert trace["step"].tolist() == sampled
    assert trace["tokens"].tolist() == [1 + s % 5 for s in sampled]
    assert trace["map_version"].tolist() == [s // 4 for s in sampled]
    rows = np.cumsum([0] + trace["tokens"].tolist())
    for i, step in enumerate(sampled):
        ids = trace["ids"][rows[i]:rows[i + 1]]  # [tokens, L, k]
        n = 1 + step % 5
        for layer in range(L):
            expected = (np.arange(n * K).reshape(n, K) + step + layer) % E
            np.testing.assert_array_equal(ids[:, layer], expected)
            np.testing.assert_array_equal(trace["resident"][rows[i]:rows[i + 1], layer],
                                          expected % 2 == 0)
        assert (trace["weights"][rows[i]:rows[i + 1]] == np.float32(1 / (step + 1))).all()


def test_the_size_bound_holds_dropping_the_oldest(tmp_path):
    folder = tmp_path / "routing"
    bound = 20_000  # bytes: a few chunks of some 25 steps each
    feed(folder, steps=200, every=1, max_bytes=bound)
    chunks = chunk_files(folder)
    assert len(chunks) >= 2 and sum(p.stat().st_size for p in chunks) <= bound
    _, trace = read_trace(folder)
    assert trace["step"][-1] == 199 and trace["step"][0] > 0  # the newest kept, the oldest gone
    assert trace["step"].tolist() == list(range(trace["step"][0], 200))


def test_another_engines_trace_is_set_aside(tmp_path):
    folder = tmp_path / "routing"
    feed(folder, steps=4, every=1, max_bytes=1 << 20)
    feed(folder, steps=8, every=1, max_bytes=1 << 20, start=4)  # the same engine, restarted
    assert read_trace(folder)[1]["step"].tolist() == list(range(8))
    TraceRecorder(folder, {**HEADER, "n_experts": 16}, 1, 1 << 20).close()
    [aside] = tmp_path.glob("routing.old-*")
    assert json.loads((aside / "header.json").read_text())["n_experts"] == E
    assert chunk_files(aside) and not chunk_files(folder)


def test_tracing_needs_a_state_dir(tmp_path):
    with pytest.raises(ConfigError, match="trace_every_steps.*state_dir"):
        tidejax.load(tmp_path, residency={"trace_every_steps": 4})
