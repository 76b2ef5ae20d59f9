"""Speculative decoding (issue 33) on a mesh that splits "tensor" over two CPU devices of one
process: a tiny DeepSeek-V3 (MLA), a tiny GLM-4.5 (GQA) and a tiny GLM-5 (DSA: an MTP layer with
an indexer of its own), each with an MTP layer that drafts well (tiny_models.repeating_mtp). The
MTP layer's params split as its family's decoder layer's (attention heads, shared-expert
intermediate; GLM-5's indexer whole, as its main layers'), its routed experts the split pool's
last MoE layer, GLM-5's index keys a pool slot of their own; the greedy tokens of four lanes
equal those of the same mesh with speculation off, drafts accepted and rejected; DeepSeek-V3's
too with half the expert rows on the disk tier, the MTP layer's among those read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.server_fixtures import REPO
from tests.support.tiny_models import repeating_mtp

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    import numpy as np
    import tidejax
    from tidejax.runtime.scheduler import GenerationRequest
    from tests.support.engine_probes import run, tokens_of

    ENGINE = {"lanes": 4, "max_context": 48, "page_size": 8, "prefill_chunk": 16,
              "warmup": False}
    PROMPTS = [np.random.RandomState(s).randint(3, 256, n).tolist()
               for s, n in ((1, 14), (2, 9), (3, 11), (4, 6))]

    def greedy(engine):
        events = run(engine, [GenerationRequest(p, 16, ignore_eos=True) for p in PROMPTS])
        return [tokens_of(got) for got in events], [got[-1].stats for got in events]

    def specs(tree):
        return jax.tree.map(lambda leaf: list(leaf.sharding.spec), tree)

    def dense(layer):  # the attention but an indexer (GLM-5's last layer reuses a pick)
        attn = {k: v for k, v in layer["attn"].items() if k != "indexer"}
        return specs({"attn": attn, "shared": layer["moe"]["shared"]})

    out = {}
    for model in sys.argv[1:]:
        off = tidejax.load(model, engine=ENGINE, distributed={"tensor_parallel": 2})
        plain, _ = greedy(off)
        off.close()
        on = tidejax.load(model, engine=ENGINE, distributed={"tensor_parallel": 2},
                          speculative={"method": "mtp", "tokens": 2})
        tokens, stats = greedy(on)
        cfg = on.loaded.cfg
        params, draft = on.loaded.step_params
        mtp = draft[f"layers_{cfg.num_layers}"]
        main = params[f"layers_{cfg.moe_layers[-1]}"]
        out[model] = {
            "plain": plain, "tokens": tokens,
            "drafted": [s["drafted_tokens"] for s in stats],
            "accepted": [s["accepted_tokens"] for s in stats],
            "mtp": dense(mtp), "main": dense(main),
            "glue": specs(mtp["eh_proj"]),
            "layers": [on.residency.n_layers, len(cfg.moe_layers)],
            "bank": list(on.state.experts.bank["gate_up"].sharding.spec)}
        index_k = getattr(on.state.cache.pages, "index_k", None)  # GLM-5's DSA pool
        if index_k is not None:
            out[model]["index_k"] = [None if k is None else [list(k.sharding.spec), k.shape[0]]
                                     for k in index_k]
            out[model]["indexer"] = [specs(layer["attn"]["indexer"]) for layer in (
                mtp, params[f"layers_{cfg.index_layers[0]}"])]
        on.close()
        if model != sys.argv[1]:
            continue
        # the first model with half the rows on disk (exact misses)
        on_disk = tidejax.load(model, engine=ENGINE, distributed={"tensor_parallel": 2},
                               speculative={"method": "mtp", "tokens": 2}, residency={
                                   "budget_experts": 8, "host_budget_experts": 12,
                                   "miss_policy": "exact"})
        out[model]["on_disk"] = greedy(on_disk)[0]
        n_main = len(cfg.moe_layers) * cfg.n_routed_experts
        out[model]["mtp_disk_reads"] = int(on_disk.residency.cache.reads_by_row[n_main:].sum())
        on_disk.close()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def on_a_split_mesh(v3_mtp, tiny_checkpoint, tmp_path_factory) -> dict:
    """SCRIPT's report by family: DeepSeek-V3, GLM-4.5 (two KV heads: one a device) and GLM-5
    (its layer 0 with an indexer, layer 1 a MoE layer reusing its pick)."""
    glm = repeating_mtp(tiny_checkpoint("glm4_moe", "qknorm_groups", seed=0),
                        tmp_path_factory.mktemp("glm-mtp") / "mtp", 0.3)
    glm5 = repeating_mtp(tiny_checkpoint("glm_moe_dsa", "topk_below", seed=5),
                         tmp_path_factory.mktemp("glm5-mtp") / "mtp", 0.3)
    models = {"deepseek_v3": v3_mtp, "glm4_moe": glm, "glm_moe_dsa": glm5}
    out = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, models.values())],
                         capture_output=True, text=True, cwd=REPO, timeout=600,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {family: got[str(path)] for family, path in models.items()}


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "glm_moe_dsa"])
def test_speculation_on_a_split_mesh_keeps_the_greedy_tokens(on_a_split_mesh, family):
    """Two devices: the MTP layer's attention and shared experts split as the last decoder
    layer's (the glue whole), its experts residency's last layer on the split bank; four
    lanes' greedy tokens those of speculation off on the same mesh, drafts accepted and some
    rejected (the verify step's rollback on the mesh)."""
    got = on_a_split_mesh[family]
    print(f"{family}: accepted {got['accepted']} of {got['drafted']} drafts")
    assert got["mtp"] == got["main"]
    assert got["mtp"]["attn"]["o_proj"]["weight"] == [None, "tensor"]  # [embed, heads]
    assert got["glue"] == {"weight": []}
    assert got["layers"][0] == got["layers"][1] + 1 and got["bank"] == [None, "tensor"]
    assert got["tokens"] == got["plain"] and all(len(t) == 16 for t in got["tokens"])
    assert 0 < sum(got["accepted"]) < sum(got["drafted"])


def test_speculation_over_the_disk_tier_on_a_split_mesh(on_a_split_mesh):
    """DeepSeek-V3 on two devices with a host budget of half the rows (the disk tier, `exact`):
    the greedy tokens of speculation off with every expert in host memory, rows of the MTP
    layer read from disk (into both shards of their host slots)."""
    got = on_a_split_mesh["deepseek_v3"]
    assert got["on_disk"] == got["plain"] and got["mtp_disk_reads"] > 0


def test_glm5_mtp_layer_indexes_through_its_own_pool_slot_on_a_split_mesh(on_a_split_mesh):
    """GLM-5: the MTP layer's indexer placed as layer 0's (whole on both devices), its index
    keys the pool's slot 2 (after the two decoder layers; layer 1 keeps none), as layer 0's."""
    got = on_a_split_mesh["glm_moe_dsa"]
    assert got["indexer"][0] == got["indexer"][1]
    assert len(got["index_k"]) == 3 and got["index_k"][1] is None
    assert got["index_k"][2] == got["index_k"][0]
