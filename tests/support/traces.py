"""What a routing trace recorded at every step must equal (tests/residency/test_trace.py in one
process, tests/distributed/test_routing_trace.py over two): the steps, picks and misses the
engine counted, and per (layer, expert) the demand history it drained."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tidejax.residency.history import History
from tidejax.residency.trace import read_trace, trace_folder

PROMPTS = ("The tide comes in", "Over the flats the boats lift from the mud")


def traced(state_dir: Path) -> dict:
    """The engine and residency tables of a traced engine on the tiny chat model
    (server_fixtures.write_chat_model): half its experts resident, misses substituted; drain_every
    1 and no decay, so the saved history is every step's counts as counted."""
    return {"engine": {"max_context": 128, "lanes": 2, "prefill_chunk": 16, "warmup": False},
            "residency": {"budget_experts": 4, "miss_policy": "substitute", "drain_every": 1,
                          "half_life": 1e9, "state_dir": str(state_dir),
                          "trace_every_steps": 1}}


def check_trace_is_what_was_counted(state_dir: Path, stats: dict) -> dict:
    """The trace under `state_dir` against the engine's final `stats` (Residency.stats) and the
    history it saved (an engine of `traced`'s tables); the trace's arrays and header."""
    header, trace = read_trace(trace_folder(state_dir))
    n_layers, n_experts, top_k = header["n_layers"], header["n_experts"], header["top_k"]
    # every step, the calibration forward at boot included, in order
    assert trace["step"].tolist() == list(range(stats["steps"]))
    assert trace["tokens"].sum() == len(trace["ids"]) == stats["wanted"] // (n_layers * top_k)
    assert (~trace["resident"]).sum() == stats["misses"] > 0
    assert trace["map_version"][-1] == stats["map_version"] > 0  # swaps happened on the way
    history = History.read(state_dir / "history.npz")
    assert history.demand.shape == (n_layers, n_experts)
    for layer in range(n_layers):
        ids = trace["ids"][:, layer].reshape(-1).astype(np.int64)
        weights = trace["weights"][:, layer].reshape(-1)
        np.testing.assert_allclose(np.bincount(ids, minlength=n_experts), history.counts[layer],
                                   rtol=1e-6)
        np.testing.assert_allclose(np.bincount(ids, weights, minlength=n_experts),
                                   history.demand[layer], rtol=1e-5)
    return {"header": header, **trace}
