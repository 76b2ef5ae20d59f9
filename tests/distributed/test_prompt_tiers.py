"""The prompt cache's host and disk tiers (kv/tiers.py) on a mesh that splits "tensor" in one
process: GLM-4.5's GQA pages split by KV head over two CPU devices. A conversation's pages
evicted from the device pool go to host memory whole (gathered from the shards); its second turn
matches them there, written back with the pool's sharding, and prefills only its new tokens; the
engine closed (host memory to disk), a new one over the folder matches them from disk. Greedy
tokens equal those of the cache off. An engine of another split finds none of the files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests.support.server_fixtures import REPO

SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tidejax
    from tidejax.kv.pages import block_hashes
    from tests.support.engine_probes import prefilled, serve

    model, folder = sys.argv[1], sys.argv[2]
    # a pool of 12 pages of 8 tokens: one sequence at max_context, so two 80-token prompts
    # after a conversation evict its pages
    engine_table = {"lanes": 1, "max_context": 96, "page_size": 8, "prefill_chunk": 16,
                    "kv_pool_tokens": 96}

    def load(tensor):
        return tidejax.load(model, engine=engine_table, cache={"disk_dir": folder},
                            distributed={"tensor_parallel": tensor})

    def ids(seed, n):
        return np.random.RandomState(seed).randint(3, 256, n).tolist()

    def matched(engine, tier):
        return engine.scheduler.cache_stats()["tiers"][tier]["matched_tokens"]

    # turn 1 of a conversation (37 tokens, 8 generated: its steps write 44 positions, 5 full
    # pages), then two 80-token prompts that evict its pages from the pool; returns turn 2
    # (48 tokens: 5 full pages before its last)
    def turn_two(engine, seed):
        prompt = ids(seed, 37)
        answer, _ = serve(engine, prompt, 8)
        for other in (seed + 1, seed + 2):
            serve(engine, ids(other, 80), 2)
        return prompt + answer + [7, 8, 9]

    def uncached(engine, prompt):  # the tokens of `prompt` with the prompt cache off
        engine.scheduler.caching = False
        try:
            tokens, stats = serve(engine, prompt, 6)
        finally:
            engine.scheduler.caching = True
        assert stats["cached_tokens"] == 0
        return tokens

    def k_spec(engine):
        return str(engine.state.cache.pages.k[0].sharding.spec)

    out = {}
    engine = load(2)
    second = turn_two(engine, 100)
    out["host_pages"] = engine.scheduler.kv_stats()["host_tier_pages"]
    spec = k_spec(engine)
    digests, host = block_hashes(second, 8)[:5], engine.scheduler.tiers.host
    entries = [host.take(digest) for digest in digests]  # (put back as they were)
    for digest, entry in zip(digests, entries):
        host.put(digest, entry)
    (out["host"], stats), out["host_prefilled"] = prefilled(
        engine, lambda: serve(engine, second, 6))
    out["host_cached"], out["host_matched"] = stats["cached_tokens"], matched(engine, "host")
    out["specs"] = [spec, k_spec(engine)]
    # each entry holds a page's rows of both KV heads; the pool's pages now hold them
    out["entry_shape"] = list(entries[0].pages.k[0].shape)
    pool = np.asarray(engine.state.cache.pages.k[0])
    out["rows_restored"] = all(np.array_equal(pool[page], entry.pages.k[0][0]) for page, entry
                               in zip(engine.scheduler.pages.match(digests), entries))
    out["host_uncached"] = uncached(engine, second)
    later = turn_two(engine, 200)  # its pages in host memory, then
    engine.close()  # on disk

    other = load(1)  # another split: another folder
    out["other_disk_pages"] = len(other.scheduler.tiers.disk)
    other.close()
    restarted = load(2)
    out["disk_pages"] = len(restarted.scheduler.tiers.disk)
    (out["disk"], stats), out["disk_prefilled"] = prefilled(
        restarted, lambda: serve(restarted, later, 6))
    out["disk_cached"], out["disk_matched"] = stats["cached_tokens"], matched(restarted, "disk")
    out["disk_uncached"] = uncached(restarted, later)
    restarted.close()
    print(json.dumps(out))
""")


def test_host_and_disk_tiers_on_a_split_mesh_serve_a_second_turn(tiny_checkpoint, tmp_path):
    model = tiny_checkpoint("glm4_moe", "qknorm_groups", seed=3)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(model), str(tmp_path / "tiers")],
                         capture_output=True, text=True, cwd=REPO, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # each second turn: 5 full pages before its last token matched (40 tokens), 8 prefilled
    assert got["host_pages"] >= 5
    assert got["host_cached"] == got["host_matched"] == 40 and got["host_prefilled"] == 8
    assert got["specs"][0] == got["specs"][1] and "tensor" in got["specs"][0]
    assert got["entry_shape"] == [1, 8, 2, 24] and got["rows_restored"]  # [1, page, kv heads, d]
    assert got["other_disk_pages"] == 0 and got["disk_pages"] >= 5
    assert got["disk_cached"] == got["disk_matched"] == 40 and got["disk_prefilled"] == 8
    assert got["host"] == got["host_uncached"] and len(got["host"]) == 6
    assert got["disk"] == got["disk_uncached"] and len(got["disk"]) == 6
