"""Speculative decoding (issue 33) over two processes on loopback (test_speculative_mesh.py has
it on one process's devices): a tiny DeepSeek-V3 whose MTP layer drafts well, the mesh split
two ways over the processes, in a pool that preempts; then over the disk tier of experts; then
sampled with seeds; a tiny GLM-4.5, whose GQA pages split by KV heads; and a tiny GLM-5, whose
MTP layer is a DSA layer with an indexer of its own.
Process 0 plans every verify step and the peer runs the same ones (its runner counts them);
the drafts kept, the rollbacks and the pages given back are process 0's decisions, from the
step's tokens, which are whole on every device."""

from __future__ import annotations

import ast
import json
import re
import textwrap

import numpy as np
import pytest

import tidejax
from tests.support.engine_probes import run, tokens_of
from tests.support.server_fixtures import free_coordinator, run_pair, write_profile
from tests.support.tiny_models import repeating_mtp
from tidejax.runtime.sampling import SamplingParams
from tidejax.runtime.scheduler import GenerationRequest

ENGINE = {"lanes": 4, "max_context": 32, "page_size": 8, "prefill_chunk": 16, "warmup": False}
PROMPTS = [np.random.RandomState(s).randint(3, 256, n).tolist()
           for s, n in ((1, 8), (2, 5), (3, 7), (4, 6))]
NEW_TOKENS = 12
POOL = {**ENGINE, "kv_pool_tokens": 64}  # 8 pages: four lanes preempt
# seeded sampling, a seed a request, with the penalties, top-k, top-p and min-p
SAMPLED = [dict(temperature=0.9, top_k=8, top_p=0.95, min_p=0.02, presence_penalty=0.3,
                frequency_penalty=0.2, repetition_penalty=1.1, seed=seed) for seed in range(4)]

LEADER = textwrap.dedent("""
    import json, sys
    from tidejax import distributed
    from tidejax.config import EngineConfig
    from tidejax.runtime.engine import Engine
    from tidejax.runtime.sampling import SamplingParams
    from tidejax.runtime.scheduler import GenerationRequest
    from tests.support.engine_probes import run, tokens_of

    profile, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    sampling = [SamplingParams(**s) for s in json.loads(sys.argv[4])]
    config = EngineConfig.from_toml(profile).with_overrides({"distributed": {"process_id": 0}})
    engine = Engine(config, distributed.start(config))
    events = run(engine, [GenerationRequest(p, n, s, ignore_eos=True)
                          for p, s in zip(prompts, sampling)])
    params, draft = engine.loaded.step_params
    mtp = draft[f"layers_{engine.loaded.cfg.num_layers}"]
    out = {"tokens": [tokens_of(got) for got in events],
           "drafted": [got[-1].stats["drafted_tokens"] for got in events],
           "accepted": [got[-1].stats["accepted_tokens"] for got in events],
           "verify_steps": engine.runner.verify_steps,
           "preemptions": engine.scheduler.totals["preemptions"],
           "o_proj": list(mtp["attn"]["o_proj"]["weight"].sharding.spec),
           "o_proj_shards": len(mtp["attn"]["o_proj"]["weight"].addressable_shards)}
    cache = engine.residency.cache
    if cache is not None:  # the disk tier: the MTP layer's rows after the main layers'
        n_main = len(engine.loaded.cfg.moe_layers) * engine.loaded.cfg.n_routed_experts
        out["mtp_disk_reads"] = int(cache.reads_by_row[n_main:].sum())
    engine.close()  # the peer stops too, its verify steps in its log
    print(json.dumps(out))
""")


def _alone(model, sampling: list[dict], **load) -> list[list]:
    """Each prompt's events on one process, one device, loaded with `load`, each prompt by its
    `sampling` (SamplingParams' fields)."""
    engine = tidejax.load(model, **load)
    events = run(engine, [GenerationRequest(p, NEW_TOKENS, SamplingParams(**s), ignore_eos=True)
                          for p, s in zip(PROMPTS, sampling)])
    engine.close()
    return events


def _plain(model) -> list[list[int]]:
    """The greedy tokens of one process, one device, without speculation."""
    return [tokens_of(events) for events in _alone(model, [{}] * len(PROMPTS), engine=ENGINE)]


@pytest.fixture(scope="module")
def plain(v3_mtp) -> list[list[int]]:
    return _plain(v3_mtp)


def _pair(v3_mtp, tmp_path, sampling=None, **residency) -> tuple[dict, str]:
    """Process 1 following, LEADER as process 0, speculating (k = 2) in a pool of 8 pages that
    preempts, each prompt by its `sampling` (SamplingParams' fields; None: greedy):
    (process 0's report, process 1's log)."""
    profile = write_profile(
        tmp_path / "pair.toml", v3_mtp, engine=POOL,
        speculative={"method": "mtp", "tokens": 2}, residency=residency,
        distributed={"num_processes": 2, "coordinator": free_coordinator(), "timeout_s": 120})
    got = run_pair(profile, LEADER, json.dumps(PROMPTS), str(NEW_TOKENS),
                   json.dumps(sampling or [{}] * len(PROMPTS)), timeout=300)
    print(f"accepted {got['accepted']} of {got['drafted']} drafts in {got['verify_steps']} "
          f"verify steps, {got['preemptions']} preemptions")
    return got, (tmp_path / "pair-peer.log").read_text()


def test_speculation_over_two_processes_keeps_the_greedy_tokens(v3_mtp, plain, tmp_path):
    """Four lanes over two processes with `method = "mtp"`, preempted (each process saves its
    own copy of a lane's pages, the MTP slot's among them): the greedy tokens of one process
    without speculation, drafts kept and rolled back on process 0, the MTP layer's attention
    split over the processes (one shard a process), and process 1 ran as many verify steps as
    process 0 planned."""
    got, peer_log = _pair(v3_mtp, tmp_path)
    assert got["tokens"] == plain and got["preemptions"] > 0
    assert 0 < sum(got["accepted"]) < sum(got["drafted"])  # kept and rolled back
    assert got["o_proj"] == [None, "tensor"] and got["o_proj_shards"] == 1
    peer = re.search(r"process 1: (\d+) verify steps run", peer_log)
    assert peer and int(peer.group(1)) == got["verify_steps"] > 0


def test_speculation_over_the_disk_tier_of_two_processes(v3_mtp, plain, tmp_path):
    """The same over a host budget of half the rows (`exact`): each process reads its shards
    of the MTP layer's rows from a prepared copy of them, as of the main layers' rows (the two
    copies joined as one source of shards: disk.joined), and both processes read rows."""
    got, peer_log = _pair(v3_mtp, tmp_path, budget_experts=8, host_budget_experts=12,
                          miss_policy="exact", state_dir=str(tmp_path / "state"))
    assert got["tokens"] == plain and got["mtp_disk_reads"] > 0
    peer = re.search(r"process 1: disk tier (\{.*\})", peer_log)
    assert peer and ast.literal_eval(peer.group(1))["disk_reads"] > 0
    assert sorted(p.name for p in (tmp_path / "state" / "experts").iterdir()) == [
        "process0-tensor2", "process1-tensor2"]


def test_sampled_speculation_over_two_processes_keeps_the_seeded_tokens(v3_mtp, plain,
                                                                        tmp_path):
    """Four seeded sampled requests speculating over two processes (the acceptance rule's
    draws in the replicated step): each request's tokens those of one process speculating in
    the same pool with the same seeds, drafts kept and rejected; sampled, not greedy."""
    got, _ = _pair(v3_mtp, tmp_path, SAMPLED)
    events = _alone(v3_mtp, SAMPLED, engine=POOL, speculative={"method": "mtp", "tokens": 2})
    assert got["tokens"] == [tokens_of(e) for e in events] != plain
    assert 0 < sum(got["accepted"]) < sum(got["drafted"])
    assert [e[-1].stats["accepted_tokens"] for e in events] == got["accepted"]


# each GLM family's tiny checkpoint (config, seed): its repeating MTP layer's drafts kept and not
GLM = {"glm4_moe": ("qknorm_groups", 0), "glm_moe_dsa": ("topk_below", 5)}


@pytest.mark.parametrize("family", GLM)
def test_glm_speculation_over_two_processes(family, tiny_checkpoint, tmp_path_factory, tmp_path):
    """GLM-4.5 (GQA, two KV heads: its pages split one head a process) and GLM-5 (DSA: MLA's
    latent pages and the index keys whole in each process, the MTP layer's indexer keys in its
    own slot) speculating over two processes: the greedy tokens of one process without
    speculation, drafts kept and rolled back, and the peer ran process 0's verify steps."""
    config, seed = GLM[family]
    glm = repeating_mtp(tiny_checkpoint(family, config, seed=seed),
                        tmp_path_factory.mktemp("glm-mtp") / "mtp", 0.3)
    got, peer_log = _pair(glm, tmp_path)
    assert got["tokens"] == _plain(glm)
    assert 0 < sum(got["accepted"]) < sum(got["drafted"])
    peer = re.search(r"process 1: (\d+) verify steps run", peer_log)
    assert peer and int(peer.group(1)) == got["verify_steps"] > 0
