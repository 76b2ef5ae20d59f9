"""The disk tier of routed experts over two processes on loopback (tests/residency/test_disk_tier.py
has it in one process): a tiny Qwen3-MoE, a bank of a quarter of its experts and a host cache of
half on each process, each process reading only its shards of each row from a prepared copy of
them in a folder of its own, its host cache following process 0's orders and maps. `exact` gives
the greedy tokens of one process with every expert in host memory, both processes reading rows;
`ring` reads its misses beside the steps on both and scores as all-in-host once they are in."""

from __future__ import annotations

import ast
import json
import re
import textwrap

import numpy as np
import pytest

import tidejax
from tests.support.server_fixtures import free_coordinator, run_pair, write_profile
from tests.support.tiny_models import served_greedy

PROMPT = np.random.RandomState(11).randint(3, 256, 24).tolist()
ENGINE = {"max_context": 64, "lanes": 1}
ROWS = 16  # 2 MoE layers x 8 experts
TIERS = {"budget_experts": ROWS // 4, "host_budget_experts": ROWS // 2}

LEADER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from tidejax import distributed
    from tidejax.config import EngineConfig
    from tidejax.runtime.engine import Engine
    from tests.support.tiny_models import served_greedy

    profile, prompt, logits = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    config = EngineConfig.from_toml(profile).with_overrides({"distributed": {"process_id": 0}})
    engine = Engine(config, distributed.start(config))
    cache, stats = engine.residency.cache, engine.residency.stats
    out = {"shards": len(engine.state.experts.pool["gate_up"].addressable_shards),
           "source": type(cache.rows).__name__}
    if config.residency.miss_policy == "exact":
        out["tokens"] = served_greedy(engine, prompt, 12)
    else:  # forwards until one misses nothing, the reads queued landing between them
        for _ in range(8):
            cache.wait(cache.reading())
            misses = stats()["misses"]
            got = engine.logits(prompt)
            if stats()["misses"] == misses:
                break
        np.save(logits, got)
    out["stats"] = stats()
    engine.close()  # the peer stops too, its disk tier's stats in its log
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe", "dense_first", num_hidden_layers=3,
                           num_key_value_heads=2)  # a KV head a device


@pytest.fixture(scope="module")
def one(checkpoint):
    """One process, every expert in host memory."""
    return tidejax.load(checkpoint, engine=ENGINE, residency={"host_budget_gib": 1.0})


def _pair(tmp_path, checkpoint, **residency) -> tuple[dict, dict]:
    """Process 1 following, LEADER as process 0: (process 0's report, process 1's disk tier
    stats from its log)."""
    profile = write_profile(
        tmp_path / "pair.toml", checkpoint, engine=ENGINE,
        residency={**TIERS, **residency, "state_dir": str(tmp_path / "state")},
        distributed={"num_processes": 2, "coordinator": free_coordinator(), "timeout_s": 120})
    got = run_pair(profile, LEADER, json.dumps(PROMPT), str(tmp_path / "logits.npy"),
                   timeout=300)
    assert got["shards"] == 1 and got["source"] == "ProcessShards"
    folders = sorted(p.name for p in (tmp_path / "state" / "experts").iterdir())
    assert folders == ["process0-tensor2", "process1-tensor2"]
    peer_log = (tmp_path / "pair-peer.log").read_text()
    found = re.search(r"process 1: disk tier (\{.*\})", peer_log)
    assert found, peer_log[-3000:]
    return got, ast.literal_eval(found.group(1))


def test_exact_over_the_disk_tier_of_two_processes_equals_all_in_host(checkpoint, one,
                                                                      tmp_path):
    """Two processes, each device a half of every expert's intermediate: `exact` over a host
    budget of half the experts (a quarter in the bank) reads rows on both processes, inside the
    steps too, each half a row (its shards, from a prepared copy of them: process<i>-tensor2),
    the peer's cache overwriting held rows where process 0's commits did, and gives the greedy
    tokens of one process with every expert in host memory."""
    got, peer = _pair(tmp_path, checkpoint, miss_policy="exact", drain_every=2, hysteresis=1.0)
    assert got["tokens"] == served_greedy(one, PROMPT, 12)
    for stats in got["stats"], peer:
        assert stats["disk_reads"] > ROWS // 4 and stats["disk_reads_in_step"] > 0
        assert stats["disk_read_bytes"] == stats["disk_reads"] * one.residency.row_bytes // 2
    assert peer["host_commit_waits"] == got["stats"]["host_commit_waits"] > 0
    assert got["stats"]["host_misses"] > 0


def test_ring_over_the_disk_tier_of_two_processes_reads_beside_the_steps(checkpoint, one,
                                                                        tmp_path):
    """`ring` with a ring slot for every row outside the bank: its misses on disk are read
    beside the steps on both processes (process 0's reads ordered to the peer in the plans),
    never in one, and once the ring holds every miss the logits are all-in-host's."""
    got, peer = _pair(tmp_path, checkpoint, miss_policy="ring", ring_slots=ROWS - ROWS // 4,
                      drain_every=1000)
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), one.logits(PROMPT),
                               rtol=1e-5, atol=1e-5)
    stats = got["stats"]
    assert stats["ring_hits"] > 0 and stats["disk_prefetches"] > 0
    for stats in got["stats"], peer:
        assert stats["disk_reads"] > ROWS // 4
        assert stats["disk_reads_in_step"] == stats["disk_read_waits_in_step"] == 0
