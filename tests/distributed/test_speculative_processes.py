"""Speculative decoding (issue 33) over two processes on loopback (test_speculative_mesh.py has
it on one process's devices): a tiny DeepSeek-V3 whose MTP layer drafts well, the mesh split
two ways over the processes. Process 0 plans every verify step and the peer runs the same ones
(its runner counts them); the drafts kept, the rollbacks and the pages given back are process
0's decisions, from the step's tokens, which are whole on every device."""

from __future__ import annotations

import json
import re
import textwrap

import numpy as np
import pytest

import tidejax
from tests.support.engine_probes import run, tokens_of
from tests.support.server_fixtures import free_coordinator, run_pair, write_profile
from tidejax.runtime.scheduler import GenerationRequest

ENGINE = {"lanes": 4, "max_context": 32, "page_size": 8, "prefill_chunk": 16, "warmup": False}
PROMPTS = [np.random.RandomState(s).randint(3, 256, n).tolist()
           for s, n in ((1, 8), (2, 5), (3, 7), (4, 6))]
NEW_TOKENS = 12

LEADER = textwrap.dedent("""
    import json, sys
    from tidejax import distributed
    from tidejax.config import EngineConfig
    from tidejax.runtime.engine import Engine
    from tidejax.runtime.scheduler import GenerationRequest
    from tests.support.engine_probes import run, tokens_of

    profile, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    config = EngineConfig.from_toml(profile).with_overrides({"distributed": {"process_id": 0}})
    engine = Engine(config, distributed.start(config))
    events = run(engine, [GenerationRequest(p, n, ignore_eos=True) for p in prompts])
    params, draft = engine.loaded.step_params
    mtp = draft[f"layers_{engine.loaded.cfg.num_layers}"]
    out = {"tokens": [tokens_of(got) for got in events],
           "drafted": [got[-1].stats["drafted_tokens"] for got in events],
           "accepted": [got[-1].stats["accepted_tokens"] for got in events],
           "verify_steps": engine.runner.verify_steps,
           "o_proj": list(mtp["attn"]["o_proj"]["weight"].sharding.spec),
           "o_proj_shards": len(mtp["attn"]["o_proj"]["weight"].addressable_shards)}
    engine.close()  # the peer stops too, its verify steps in its log
    print(json.dumps(out))
""")


def test_speculation_over_two_processes_keeps_the_greedy_tokens(v3_mtp, tmp_path):
    """Four lanes over two processes with `method = "mtp"`, k = 2: the greedy tokens of one
    process without speculation, drafts accepted on process 0, the MTP layer's attention split
    over the processes (one shard a process), and process 1 ran as many verify steps as
    process 0 planned."""
    plain = tidejax.load(v3_mtp, engine=ENGINE)
    requests = [GenerationRequest(p, NEW_TOKENS, ignore_eos=True) for p in PROMPTS]
    expected = [tokens_of(events) for events in run(plain, requests)]
    plain.close()
    profile = write_profile(
        tmp_path / "pair.toml", v3_mtp, engine=ENGINE, speculative={"method": "mtp", "tokens": 2},
        distributed={"num_processes": 2, "coordinator": free_coordinator(), "timeout_s": 120})
    got = run_pair(profile, LEADER, json.dumps(PROMPTS), str(NEW_TOKENS), timeout=300)
    print(f"accepted {got['accepted']} of {got['drafted']} drafts in {got['verify_steps']} "
          "verify steps")
    assert got["tokens"] == expected
    assert 0 < sum(got["accepted"]) < sum(got["drafted"])  # kept and rolled back
    assert got["o_proj"] == [None, "tensor"] and got["o_proj_shards"] == 1
    peer = re.search(r"process 1: (\d+) verify steps run",
                     (tmp_path / "pair-peer.log").read_text())
    assert peer and int(peer.group(1)) == got["verify_steps"] > 0
