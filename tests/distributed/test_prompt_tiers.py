"""The prompt cache's host and disk tiers (kv/tiers.py) under tensor parallelism, GLM-4.5's GQA
pages split by KV head. In one process over two CPU devices: a conversation's pages evicted from
the device pool go to pinned host memory, split as the pool is; its second turn matches them
there, written back with the pool's sharding, and prefills only its new tokens; the engine closed
(host memory to disk), a new one over the folder matches them from disk. Over two processes on
loopback: every process keeps its own shards of each page, in host memory and in a folder of its
own, and a restore writes back as many pages as both hold (one process's corrupt file shortens
it for both). Greedy tokens equal those of the cache off."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tidejax.kv.pages import block_hashes
from tests.support.server_fixtures import REPO, free_coordinator, run_pair, write_profile

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
    out["host_pages"] = engine.scheduler.cache_stats()["processes"][0]["host"]["pages"]
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
    out["entry_memory"] = entries[0].pages.k[0].sharding.memory_kind  # one process: pinned
    pool = np.asarray(engine.state.cache.pages.k[0])
    out["rows_restored"] = all(np.array_equal(pool[page], np.asarray(entry.pages.k[0])[0])
                               for page, entry in zip(engine.scheduler.pages.match(digests),
                                                      entries))
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
           "XLA_FLAGS": os.environ["XLA_FLAGS"] + " --xla_force_host_platform_device_count=2"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(model), str(tmp_path / "tiers")],
                         capture_output=True, text=True, cwd=REPO, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # each second turn: 5 full pages before its last token matched (40 tokens), 8 prefilled
    assert got["host_pages"] >= 5
    assert got["host_cached"] == got["host_matched"] == 40 and got["host_prefilled"] == 8
    assert got["specs"][0] == got["specs"][1] and "tensor" in got["specs"][0]
    assert got["entry_shape"] == [1, 8, 2, 24] and got["rows_restored"]  # [1, page, kv heads, d]
    assert got["entry_memory"] == "pinned_host"
    assert got["other_disk_pages"] == 0 and got["disk_pages"] >= 5
    assert got["disk_cached"] == got["disk_matched"] == 40 and got["disk_prefilled"] == 8
    assert got["host"] == got["host_uncached"] and len(got["host"]) == 6
    assert got["disk"] == got["disk_uncached"] and len(got["disk"]) == 6


PAIR = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np
    from tidejax import distributed
    from tidejax.config import EngineConfig
    from tidejax.runtime.engine import Engine
    from tests.support.engine_probes import serve, tier_counts, tiered_turn

    profile, phase, saved = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    config = EngineConfig.from_toml(profile).with_overrides({"distributed": {"process_id": 0}})
    engine = Engine(config, distributed.start(config))

    def ids(seed, n):
        return np.random.RandomState(seed).randint(3, 256, n).tolist()

    # turn 1 of a conversation (37 tokens, 8 generated: 5 full pages written), then two
    # 80-token prompts that evict its pages from the pool; returns turn 2 (48 tokens: 5 full
    # pages before its last)
    def turn_two(seed):
        prompt = ids(seed, 37)
        answer, _ = serve(engine, prompt, 8)
        for other in (seed + 1, seed + 2):
            serve(engine, ids(other, 80), 2)
        return prompt + answer + [7, 8, 9]

    out = {}
    if phase == "host":
        out["host"] = tiered_turn(engine, turn_two(100))
        out["hits"] = tier_counts(engine, "host", "hits", 5)
        later = {"kept": turn_two(200), "spoiled": turn_two(300)}  # to host memory, then disk
        later["last"] = ids(302, 80)  # turn_two(300)'s last prompt: on the device at close
        out["host_pages"] = len(engine.scheduler.tiers.host)
        saved.write_text(json.dumps(later))
    else:
        later = json.loads(saved.read_text())
        out["disk_pages"] = len(engine.scheduler.tiers.disk)
        for name in ("kept", "spoiled", "last"):
            out[name] = tiered_turn(engine, later[name])
        out["hits"] = tier_counts(engine, "disk", "hits", 16)
    engine.close()  # the peer stops too; both write their device pages and host tiers to disk
    print(json.dumps(out))
""")


def _pair(tmp_path: Path, model: Path, phase: str) -> dict:
    """Process 1 following, then PAIR as process 0 for `phase`; its report once both stopped."""
    profile = write_profile(
        tmp_path / f"{phase}.toml", model,
        engine={"lanes": 1, "max_context": 96, "page_size": 8, "prefill_chunk": 16,
                "kv_pool_tokens": 96},  # one sequence at max_context: 12 pages of 8 tokens
        cache={"disk_dir": str(tmp_path / "tiers")},
        distributed={"num_processes": 2, "coordinator": free_coordinator(), "timeout_s": 120})
    return run_pair(profile, PAIR, phase, str(tmp_path / "prompts.json"))


def test_two_processes_each_cache_their_shards_and_agree_on_a_restore(tiny_checkpoint, tmp_path):
    """Two processes, GLM-4.5's two KV heads one on each. A second turn matches its 5 evicted
    pages from host memory (40 tokens, 8 prefilled: both processes held their shards). Both
    restarted over the folder (each wrote its host tier to a folder of its own at stop), a
    second turn matches from disk (40 tokens, 8 prefilled); another, whose third page's file
    process 1 finds corrupt (skipped and removed there, with a log line), restores 2 pages on
    both (16 tokens, 32 prefilled) while process 0's file stays (process 1's is written anew at
    close: the page was prefilled again, in the device pool then); the last prompt before the
    first stop, whose pages were still in the device pool then (each process wrote its shards
    of them at close, a log line on the peer), matches its 9 pages from disk (72 tokens, 8
    prefilled). Greedy tokens equal the cache off's every time. Each process counts the pages
    its tiers gave back (process 1's reported to process 0): the agreed ones, on both alike."""
    model = tiny_checkpoint("glm4_moe", "qknorm_groups", seed=3)
    host = _pair(tmp_path, model, "host")
    assert host["host_pages"] >= 10
    assert host["host"] == {"same": True, "cached": 40, "prefilled": 8, "device": 0, "host": 40,
                            "disk": 0}
    assert host["hits"] == {"0": 5, "1": 5}  # each process's host tier gave its 5 pages' shards
    prompts = json.loads((tmp_path / "prompts.json").read_text())
    folders = sorted((tmp_path / "tiers" / "prompt_cache").glob("*/process*"))
    assert [folder.name for folder in folders] == ["process0", "process1"]
    spoiled = block_hashes(prompts["spoiled"], 8)[2].hex() + ".page"
    target = folders[1] / spoiled
    raw = bytearray(target.read_bytes())
    raw[-5] ^= 0xFF  # a byte of the payload
    target.write_bytes(bytes(raw))

    disk = _pair(tmp_path, model, "disk")
    assert disk["disk_pages"] >= 10
    assert disk["kept"] == {"same": True, "cached": 40, "prefilled": 8, "device": 0, "host": 0,
                            "disk": 40}
    assert disk["spoiled"] == {"same": True, "cached": 16, "prefilled": 32, "device": 0,
                               "host": 0, "disk": 16}
    assert disk["last"] == {"same": True, "cached": 72, "prefilled": 8, "device": 0, "host": 0,
                            "disk": 72}
    # pages written back, on each process: 5 + 2 (process 0 loaded 5 there, 3 kept unserved) + 9
    assert disk["hits"] == {"0": 16, "1": 16}
    assert re.search(r"prompt cache: \d+ pages written to disk under \S*process1",
                     (tmp_path / "host-peer.log").read_text())
    peer_log = (tmp_path / "disk-peer.log").read_text()
    assert re.search(rf"disk entry \S*{spoiled} is corrupt", peer_log), peer_log[-3000:]
    # removed there; the page prefilled again was on the device at close: written anew
    assert target.read_bytes() != bytes(raw) and (folders[0] / spoiled).exists()


V41_PAIR = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np
    from tidejax import distributed
    from tidejax.config import EngineConfig
    from tidejax.runtime.api import EngineStats
    from tidejax.runtime.engine import Engine
    from tidejax.server.metrics import Metrics
    from tests.support.engine_probes import serve, tier_counts, tiered_turn

    profile, phase, saved = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    config = EngineConfig.from_toml(profile).with_overrides({"distributed": {"process_id": 0}})
    engine = Engine(config, distributed.start(config))
    ids = np.load(Path(config.model.path) / "input_ids.npy")[0].tolist()

    # turn 1 (32 tokens: a page, a lane snapshot at its end; 8 generated), then another
    # 32-token prompt that evicts its page with the snapshot; returns turn 2 (45 tokens)
    def converse(first, seed):
        answer, _ = serve(engine, first, 8)
        serve(engine, np.random.RandomState(seed).randint(3, 250, 32).tolist(), 2)
        return first + answer + ids[50:55]

    out = {}
    if phase == "host":
        out["turn"] = tiered_turn(engine, converse(ids[:32], 7))
        out["hits"] = tier_counts(engine, "host", "hits", 1)
        out["pages"] = tier_counts(engine, "host", "pages", 1)
        saved.write_text(json.dumps(converse(ids[16:48], 8)))  # to host memory, then disk
        out["metrics"] = Metrics().render(EngineStats(cache=engine.scheduler.cache_stats()), 0)
    else:
        out["pages"] = tier_counts(engine, "disk", "pages", 1)  # at boot
        out["turn"] = tiered_turn(engine, json.loads(saved.read_text()))
        out["hits"] = tier_counts(engine, "disk", "hits", 1)
    engine.close()
    print(json.dumps(out))
""")


def test_v41_lane_snapshots_restore_from_both_processes_tiers(tmp_path):
    """DeepSeek-V4.1 (the golden tiny_a: window rings, group buffers and Engram look-back in
    its lanes, a pool of two 32-token pages; its pages and lanes whole on every device, so each
    process keeps its own copy of each page and snapshot) over two processes on loopback. Turn 1's
    page and lane snapshot go to both processes' host memory; turn 2 restores both there (32
    tokens, 13 prefilled) with the cache off's greedy tokens, a hit of each process's host tier
    (process 1's counts reported to process 0: its /metrics shows both). Both restarted over
    the folder (each wrote its host tier to disk at stop), another conversation's turn 2
    restores from each process's disk tier, again with the cache off's tokens."""
    model = Path(__file__).parents[1] / "data" / "golden_v41" / "tiny_a"

    def pair(phase: str) -> dict:
        profile = write_profile(
            tmp_path / f"{phase}.toml", model,
            engine={"lanes": 1, "max_context": 64, "page_size": 32, "prefill_chunk": 16,
                    "kv_pool_tokens": 64,
                    "compile_cache": str(tmp_path / "jit")},  # the restart's small jits kept
            cache={"disk_dir": str(tmp_path / "tiers")},
            distributed={"num_processes": 2, "coordinator": free_coordinator(), "timeout_s": 120})
        return run_pair(profile, V41_PAIR, phase, str(tmp_path / "turn.json"))

    host = pair("host")
    assert host["turn"] == {"same": True, "cached": 32, "prefilled": 13, "device": 0, "host": 32,
                            "disk": 0}
    assert host["hits"] == {"0": 1, "1": 1} and min(host["pages"].values()) >= 1
    for process in (0, 1):
        assert re.search(rf'^tidejax_prompt_cache_tier_hits_total\{{process="{process}",'
                         rf'tier="host"\}} 1$', host["metrics"], re.M), host["metrics"]
        assert re.search(rf'^tidejax_prompt_cache_tier_bytes\{{process="{process}",'
                         rf'tier="host"\}} [1-9]\d*$', host["metrics"], re.M)
    disk = pair("disk")
    assert min(disk["pages"].values()) >= 2  # both conversations' turn-1 pages at least
    assert disk["turn"] == {"same": True, "cached": 32, "prefilled": 13, "device": 0, "host": 0,
                            "disk": 32}
    assert disk["hits"] == {"0": 1, "1": 1}


WARM_PAIR = textwrap.dedent("""
    import json, sys
    from tidejax import distributed
    from tidejax.config import EngineConfig
    from tidejax.runtime.engine import Engine
    from tests.runtime.test_compiles import counting_compiles
    from tests.support.engine_probes import serve

    config = EngineConfig.from_toml(sys.argv[1]).with_overrides({"distributed": {"process_id": 0}})
    engine = Engine(config, distributed.start(config))
    engine.warmup([37, 48])

    def turn_1(seed):  # 37 tokens, 8 generated; returns turn 2 (48 tokens: 2 full pages first)
        prompt = [3 + (11 * seed + 7 * j) % 200 for j in range(37)]
        return prompt + serve(engine, prompt, 8)[0] + [7, 8, 9]

    second = turn_1(1)
    for seed in (2, 3, 4):  # their pages evict turn 1's to host memory
        turn_1(seed)
    with counting_compiles() as names:
        cached = serve(engine, second, 4)[1]["cached_tokens"]
    host = engine.scheduler.cache_stats()["tiers"]["host"]["matched_tokens"]
    engine.close()
    print(json.dumps({"compiled": names, "cached": cached, "host": host}))
""")


def test_a_restore_across_processes_compiles_nothing_after_warmup(tiny_checkpoint, tmp_path):
    """Two processes (GLM-4.5's two KV heads one on each), warmed up for the lengths of the
    turns served: a turn 2 restored from host memory compiles nothing. Its agreement on the
    run both processes hold (parallel.agree_min, a jitted min over the mesh) compiled there
    until the warm-up's restore ran it too."""
    model = tiny_checkpoint("glm4_moe", "qknorm_groups", seed=3)
    profile = write_profile(
        tmp_path / "warm.toml", model,
        engine={"lanes": 1, "max_context": 64, "page_size": 16, "prefill_chunk": 48,
                "kv_pool_tokens": 64},  # 4 pages of 16 tokens: one sequence at max_context
        cache={"disk_dir": str(tmp_path / "tiers")},
        distributed={"num_processes": 2, "coordinator": free_coordinator(), "timeout_s": 120,
                     "tensor_parallel": 2})
    assert run_pair(profile, WARM_PAIR) == {"compiled": [], "cached": 32, "host": 32}
