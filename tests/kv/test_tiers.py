"""The prompt cache's host and disk tiers (kv/tiers.py): a KV pool too small to keep a
conversation's pages on the device spills them to host memory (pinned: jax's CPU backend has
it), a next turn matches them there and prefills only its new tokens; a new engine over the same
folder matches them on disk; a corrupt disk entry is skipped, never served. Greedy tokens equal
those of full forwards (no cache at all) and of the same engine with the cache off. A disk entry
of one process's shards of a page goes to file and back as such."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import tidejax
from tidejax import parallel
from tidejax.kv.pages import block_hashes
from tidejax.kv.tiers import DiskTier, Spilled
from tidejax.runtime.api import EngineStats
from tidejax.runtime.sampling import SamplingParams
from tidejax.server.metrics import Metrics
from tests.support.engine_probes import prefilled, serve

V41 = Path(__file__).parents[1] / "data" / "golden_v41" / "tiny_a"
# a pool of 12 pages of 8 tokens: one sequence at max_context, so an 80-token prompt after a
# conversation evicts most of the conversation's pages, and a second one the rest
ENGINE = {"lanes": 1, "max_context": 96, "page_size": 8, "prefill_chunk": 16,
          "kv_pool_tokens": 96}


def ids(seed: int, n: int) -> list[int]:
    return np.random.RandomState(seed).randint(3, 256, n).tolist()


def greedy(engine, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by full forwards (Engine.logits: a scratch cache of its own, no pages)."""
    out = []
    while len(out) < n:
        out.append(int(np.argmax(engine.logits(list(prompt) + out)[-1])))
    return out


def uncached(engine, prompt: list[int], n: int, sampling=SamplingParams()) -> list[int]:
    """serve's tokens with the prompt cache off (it matches nothing; its stats say so)."""
    engine.scheduler.caching = False
    try:
        tokens, stats = serve(engine, prompt, n, sampling)
    finally:
        engine.scheduler.caching = True
    assert stats["cached_tokens"] == 0
    return tokens


def matched(engine, tier: str) -> int:
    return engine.scheduler.cache_stats()["tiers"][tier]["matched_tokens"]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v3", "qlora_groups", seed=5, num_hidden_layers=2)


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiers_disk")


@pytest.fixture(scope="module")
def engine(model_dir, disk_dir):
    """The engine of the first run; test_a_restart_matches_from_disk closes it (its host tier
    goes to disk) and starts another over the same folder."""
    return tidejax.load(model_dir, engine=ENGINE, cache={"disk_dir": str(disk_dir)})


def converse(engine, seed: int) -> list[int]:
    """Turn 1 of a conversation (37 tokens, 8 generated: its steps write 44 positions, 5 full
    pages), then two unrelated 80-token prompts that evict all of its pages from the pool;
    returns turn 2 (turn 1, its answer and 3 new tokens: 48, so 5 full pages before its last)."""
    first = ids(seed, 37)
    answer, _ = serve(engine, first, 8)
    for other in (seed + 1, seed + 2):
        serve(engine, ids(other, 80), 2)
    return first + answer + [7, 8, 9]


def test_a_second_turn_matches_from_host_memory(engine):
    scheduler = engine.scheduler
    device_evictions = scheduler.cache_stats()["tiers"]["device"]["evictions"]
    second = converse(engine, 100)
    assert scheduler.cache_stats()["tiers"]["device"]["evictions"] > device_evictions
    held = scheduler.cache_stats()["processes"][0]["host"]["pages"]
    assert held == len(scheduler.tiers.host) >= 5
    # the evicted pages wait in pinned host memory (jax's CPU backend has it, as a GPU does),
    # counted in the host tier's bytes
    host_tier = scheduler.tiers.host
    leaves = jax.tree.leaves([host_tier._entries[digest].pages
                              for digest in block_hashes(second, 8)[:5]])
    assert leaves and all(isinstance(leaf, jax.Array) and leaf.sharding.memory_kind
                          == "pinned_host" for leaf in leaves)
    assert host_tier.bytes == sum(entry.nbytes for entry in host_tier._entries.values()) > 0
    host, device = matched(engine, "host"), matched(engine, "device")
    (got, stats), count = prefilled(engine, lambda: serve(engine, second, 6))
    assert stats["cached_tokens"] == 40 and count == len(second) - 40 == 8
    assert matched(engine, "host") - host == 40 and matched(engine, "device") == device
    # the restored pages are the device's again: a next request matches them there
    (again, stats), count = prefilled(engine, lambda: serve(engine, second, 6))
    assert matched(engine, "device") - device == 40 and count == 8
    # last: an uncached run leaves second's keys in the unused pages
    assert got == again == uncached(engine, second, 6) == greedy(engine, second, 6)


def test_a_penalized_turn_from_host_memory_sees_its_cached_prompt_tokens(engine):
    """A second turn restored from host memory under a repetition penalty (over the prompt's
    tokens too, the cached ones no step runs among them): the sampled tokens of the cache off."""
    second = converse(engine, 400)
    sampled = SamplingParams(temperature=0.9, seed=5, repetition_penalty=1.5)
    host = matched(engine, "host")
    got, stats = serve(engine, second, 6, sampled)
    assert stats["cached_tokens"] == 40 and matched(engine, "host") - host == 40
    assert got == uncached(engine, second, 6, sampled)


def test_a_restart_matches_from_disk_and_skips_a_corrupt_entry(engine, model_dir, disk_dir,
                                                               caplog):
    """Two conversations spilled to host memory; closing the engine writes them to disk. A new
    engine over the folder finds them: one's turn 2 matches from disk; the other's first page
    is corrupted on disk first, so its turn 2 is refused that entry (one log line) and
    prefills from its first token, with the same tokens."""
    kept, spoiled = converse(engine, 200), converse(engine, 300)
    engine.close()
    files = {p.stem: p for p in disk_dir.rglob("*.page")}
    target = files[block_hashes(spoiled, 8)[0].hex()]
    raw = bytearray(target.read_bytes())
    raw[-5] ^= 0xFF  # a byte of the payload
    target.write_bytes(bytes(raw))

    restarted = tidejax.load(model_dir, engine=ENGINE, cache={"disk_dir": str(disk_dir)})
    try:
        assert len(restarted.scheduler.tiers.disk) == len(files)
        (got, stats), count = prefilled(restarted, lambda: serve(restarted, kept, 6))
        assert stats["cached_tokens"] == 40 and count == 8 and matched(restarted, "disk") == 40
        assert got == greedy(restarted, kept, 6)
        with caplog.at_level(logging.WARNING, logger="tidejax"):
            (got, stats), count = prefilled(restarted, lambda: serve(restarted, spoiled, 6))
        assert stats["cached_tokens"] == 0 and count == len(spoiled)
        assert [r for r in caplog.records if "corrupt" in r.getMessage()
                and target.name in r.getMessage()]
        assert not target.exists() and matched(restarted, "disk") == 40
        assert got == greedy(restarted, spoiled, 6)
        text = Metrics().render(EngineStats(cache=restarted.scheduler.cache_stats()), 0)
        assert re.search(r'^tidejax_prompt_cache_matched_tokens_total\{tier="disk"\} 40$', text,
                         re.M), text
        assert re.search(r'^tidejax_prompt_cache_evictions_total\{tier="host"\} \d+$', text, re.M)
        # this process's own tiers: the 5 pages restored from disk, the files it holds
        assert re.search(r'^tidejax_prompt_cache_tier_hits_total\{process="0",tier="disk"\} 5$',
                         text, re.M), text
        assert re.search(rf'^tidejax_prompt_cache_tier_pages\{{process="0",tier="disk"\}} '
                         rf'{len(restarted.scheduler.tiers.disk)}$', text, re.M)
    finally:
        restarted.close()


def test_a_v41_lane_snapshot_travels_with_its_page_through_host_memory():
    """DeepSeek-V4.1 (the golden tiny_a: window rings, group buffers and Engram look-back in
    its lanes) on a pool of two 32-token pages: turn 1 (32 tokens, a snapshot at its page's
    end) is evicted by another 32-token prompt, its page and snapshot go to host memory
    together; turn 2 gets both back (the page into the pool, the snapshot into its lane) and
    prefills only the 13 tokens past turn 1, with the tokens of the cache off (without the
    snapshot's write they differ)."""
    ids = np.load(V41 / "input_ids.npy")[0].tolist()
    engine = tidejax.load(V41, engine={"lanes": 1, "max_context": 64, "prefill_chunk": 16,
                                          "page_size": 32, "kv_pool_tokens": 64})
    scheduler = engine.scheduler
    assert scheduler.snapshots
    first = ids[:32]
    answer, _ = serve(engine, first, 8)
    serve(engine, ids[32:64], 2)  # the same chunk shapes as turn 1: no new compiles
    page = block_hashes(first, 32)[0]
    assert page in scheduler.tiers.host and scheduler.tiers.host.has_snapshot(page)
    second = first + answer + ids[50:55]
    (got, stats), count = prefilled(engine, lambda: serve(engine, second, 6))
    assert stats["cached_tokens"] == 32 and count == 13 and matched(engine, "host") == 32
    assert got == uncached(engine, second, 6)


def test_pages_still_on_the_device_at_close_go_to_disk(model_dir, tmp_path, caplog):
    """Turn 1 of a conversation stays in the device pool (nothing evicted, the host tier
    empty); a clean close writes its 5 indexed pages to disk (log lines count them); a new
    engine over the folder matches turn 2 there and prefills only its 8 new tokens, with the
    cache off's greedy tokens. Under a disk budget of 3 pages, close writes the 3 most recently
    used: a sequence's first pages (its last are released first)."""
    first = ids(500, 37)
    engine = tidejax.load(model_dir, engine=ENGINE, cache={"disk_dir": str(tmp_path / "a")})
    answer, _ = serve(engine, first, 8)
    second = first + answer + [7, 8, 9]
    hashes = block_hashes(second, 8)[:5]
    scheduler = engine.scheduler
    assert scheduler.pages.evictions == 0 and len(scheduler.tiers.host) == 0
    assert [digest for digest, _, _ in scheduler.pages.indexed()] == hashes[::-1]
    size = scheduler.tiers.disk.entry_bytes(False)
    with caplog.at_level(logging.INFO, logger="tidejax"):
        engine.close()
    assert "5 of the device pool's 5 indexed pages go to disk at close" in caplog.text
    assert "5 pages written to disk" in caplog.text
    assert {p.stem for p in (tmp_path / "a").rglob("*.page")} == {h.hex() for h in hashes}

    restarted = tidejax.load(model_dir, engine=ENGINE, cache={"disk_dir": str(tmp_path / "a")})
    try:
        (got, stats), count = prefilled(restarted, lambda: serve(restarted, second, 6))
        assert stats["cached_tokens"] == 40 and count == 8 and matched(restarted, "disk") == 40
        assert got == uncached(restarted, second, 6)
    finally:
        restarted.close()

    small = tidejax.load(model_dir, engine=ENGINE, cache={"disk_dir": str(tmp_path / "b"),
                                                          "disk_gib": 3 * size / 2**30})
    serve(small, first, 8)
    small.close()
    assert {p.stem for p in (tmp_path / "b").rglob("*.page")} == {h.hex() for h in hashes[:3]}


def test_a_v41_restore_keeps_every_page_s_snapshot_for_a_shorter_match():
    """DeepSeek-V4.1 (the golden tiny_a) on a pool of four 16-token pages, host memory alone:
    a 48-token prompt's 3 pages (a lane snapshot at each end) are evicted to host memory and
    restored by a prompt that extends it; a next prompt that shares only its first page
    matches it on the device (the restore kept that page's snapshot too: without it, the page
    would match nothing and the host tier no longer holds it) and prefills only its 10 new
    tokens, with the cache off's tokens."""
    ids = np.load(V41 / "input_ids.npy")[0].tolist()
    engine = tidejax.load(V41, engine={"lanes": 1, "max_context": 64, "prefill_chunk": 16,
                                          "page_size": 16, "kv_pool_tokens": 64},
                          cache={"disk_gib": 0})
    scheduler = engine.scheduler
    assert scheduler.tiers.disk is None
    serve(engine, ids[:48], 2)
    serve(engine, np.random.RandomState(7).randint(3, 250, 48).tolist(), 2)  # evicts them
    hashes = block_hashes(ids[:48], 16)
    assert all(scheduler.tiers.host.has_snapshot(digest) for digest in hashes)
    longer = ids[:49]
    (got_longer, stats), count = prefilled(engine, lambda: serve(engine, longer, 2))
    assert stats["cached_tokens"] == 48 and count == 1 and matched(engine, "host") == 48
    assert not any(digest in scheduler.tiers.host for digest in hashes)
    shorter = ids[:16] + ids[50:60]
    device = matched(engine, "device")
    (got, stats), count = prefilled(engine, lambda: serve(engine, shorter, 6))
    assert stats["cached_tokens"] == 16 and count == 10 and matched(engine, "device") - device == 16
    assert matched(engine, "host") == 48
    # last: an uncached run evicts the cached pages
    assert got == uncached(engine, shorter, 6) and got_longer == uncached(engine, longer, 2)


def test_a_v41_page_on_the_device_at_close_goes_to_disk_with_its_snapshot(tmp_path):
    """DeepSeek-V4.1 (the golden tiny_a): turn 1's page (32 tokens, a lane snapshot at its end)
    is still in the device pool at close; it goes to disk with its snapshot, and a new engine
    over the folder restores both for turn 2, which prefills only the 13 tokens past turn 1,
    with the cache off's tokens."""
    ids = np.load(V41 / "input_ids.npy")[0].tolist()
    settings = {"lanes": 1, "max_context": 64, "prefill_chunk": 16, "page_size": 32,
                "kv_pool_tokens": 64}
    engine = tidejax.load(V41, engine=settings, cache={"disk_dir": str(tmp_path)})
    first = ids[:32]
    answer, _ = serve(engine, first, 8)
    assert engine.scheduler.pages.snapshots == 1 and len(engine.scheduler.tiers.host) == 0
    engine.close()
    restarted = tidejax.load(V41, engine=settings, cache={"disk_dir": str(tmp_path)})
    try:
        page = block_hashes(first, 32)[0]
        assert restarted.scheduler.tiers.disk.has_snapshot(page)
        second = first + answer + ids[50:55]
        (got, stats), count = prefilled(restarted, lambda: serve(restarted, second, 6))
        assert stats["cached_tokens"] == 32 and count == 13 and matched(restarted, "disk") == 32
        assert got == uncached(restarted, second, 6)
    finally:
        restarted.close()


def test_the_disk_tier_keeps_its_budget_and_finds_its_files_again(tmp_path, caplog):
    """Five entries into a budget of three: the two least recently used files are deleted; no
    temporary file is left. A new DiskTier over the folder finds the three (an interrupted
    write's temporary file removed, a file that is not an entry removed with a log line) and
    reads back the bytes written."""
    template = Spilled({"k": jax.ShapeDtypeStruct((1, 8, 4), jnp.bfloat16)})

    def entry(i: int) -> Spilled:
        return Spilled({"k": np.full((1, 8, 4), i, jnp.bfloat16)})

    sizing = DiskTier(tmp_path / "sizing", 1 << 30, template)
    sizing.put(b"\0" * 16, entry(0))
    sizing.close()
    size = sizing.bytes
    assert sizing.entry_bytes(False) == size  # what close's choice of device pages counts
    folder = tmp_path / "tier"
    disk = DiskTier(folder, 3 * size, template)
    digests = [bytes([i]) * 16 for i in range(5)]
    for i, digest in enumerate(digests):
        disk.put(digest, entry(i))
        disk.flush()  # one by one: the least recently used order is the order written
    assert len(disk) == 3 and disk.evictions == 2 and disk.bytes == 3 * size
    assert sorted(p.name for p in folder.iterdir()) == sorted(d.hex() + ".page"
                                                              for d in digests[2:])
    disk.close()
    (folder / "half.tmp").write_bytes(b"half")
    junk = folder / (b"\7".hex() * 16 + ".page")
    junk.write_bytes(b"not an entry")
    with caplog.at_level(logging.WARNING, logger="tidejax"):
        again = DiskTier(folder, 3 * size, template)
    assert not junk.exists() and not (folder / "half.tmp").exists()
    assert [r for r in caplog.records if junk.name in r.getMessage()]
    assert len(again) == 3 and digests[4] in again and digests[1] not in again
    assert np.array_equal(again.read(digests[4]).pages["k"], entry(4).pages["k"])
    again.close()


def test_the_disk_tier_keeps_a_process_s_shards_of_a_page(tmp_path):
    """An entry whose leaf is this process's shards of a page split over processes (LocalShards:
    its KV heads here, a peer's elsewhere) goes to file as its shards' bytes and comes back as
    LocalShards on the same device; a tier that expects the page whole (another layout) refuses
    the file."""
    device = jax.devices()[0]
    where = NamedSharding(parallel.make_mesh(), PartitionSpec(None, None, "tensor"))
    data = np.arange(16, dtype=np.float32).reshape(1, 8, 2).astype(jnp.bfloat16)
    template = Spilled({"k": parallel.LocalShards(
        (1, 8, 4), where, ((device, jax.ShapeDtypeStruct((1, 8, 2), jnp.bfloat16)),))})
    disk = DiskTier(tmp_path, 1 << 20, template)
    digest = b"\1" * 16
    disk.put(digest, Spilled({"k": parallel.LocalShards((1, 8, 4), where, ((device, data),))}))
    disk.close()
    back = DiskTier(tmp_path, 1 << 20, template).read(digest).pages["k"]
    assert isinstance(back, parallel.LocalShards) and back.shape == (1, 8, 4)
    assert back.shards[0][0] == device and np.array_equal(back.shards[0][1], data)
    whole = DiskTier(tmp_path, 1 << 20, Spilled({"k": jax.ShapeDtypeStruct((1, 8, 4),
                                                                           jnp.bfloat16)}))
    assert whole.read(digest) is None and digest not in whole


def split_between_the_device_and_host_memory():
    """DeepSeek-V4.1 (the golden tiny_a) on a pool of four 16-token pages, host memory alone:
    a 33-token prompt prefills one chunk of 32, so its first page has no lane snapshot and its
    second one has; another prompt evicts the second page (the last released, the first out)
    to host memory with its snapshot while the first stays on the device. The engine and a
    40-token prompt that extends turn 1."""
    ids = np.load(V41 / "input_ids.npy")[0].tolist()
    engine = tidejax.load(V41, engine={"lanes": 1, "max_context": 64, "prefill_chunk": 32,
                                       "page_size": 16, "kv_pool_tokens": 64},
                          cache={"disk_gib": 0})
    scheduler = engine.scheduler
    serve(engine, ids[:33], 2)
    first, second = block_hashes(ids[:32], 16)
    serve(engine, np.random.RandomState(7).randint(3, 250, 33).tolist(), 2)  # evicts page 2
    assert scheduler.pages.match([first]) and not scheduler.pages.match([first], True)
    assert second in scheduler.tiers.host and scheduler.tiers.host.has_snapshot(second)
    return engine, ids[:40]


def test_a_v41_match_split_between_the_device_and_host_memory_takes_both_pages():
    """The split pages (split_between_the_device_and_host_memory): the prompt matches both,
    the first on the device, the second restored with its snapshot (the last page boundary
    with a snapshot on any tier), and prefills only its 8 new tokens, with the cache off's
    tokens."""
    engine, prompt = split_between_the_device_and_host_memory()
    (got, stats), count = prefilled(engine, lambda: serve(engine, prompt, 6))
    assert stats["cached_tokens"] == 32 and count == 8
    assert (matched(engine, "device"), matched(engine, "host")) == (16, 16)
    assert got == uncached(engine, prompt, 6)


def test_a_v41_split_match_whose_restore_comes_back_empty_falls_back():
    """The split pages, with the host entry lost between the match and the restore (the
    runner loads nothing): the match falls back to the last device page with a snapshot (none
    here), the request takes a page of its own for the shared first one and prefills every
    token, with the cache off's tokens."""
    engine, prompt = split_between_the_device_and_host_memory()
    engine.scheduler.tiers.load = lambda digests: []
    (got, stats), count = prefilled(engine, lambda: serve(engine, prompt, 6))
    assert stats["cached_tokens"] == 0 and count == 40
    assert (matched(engine, "device"), matched(engine, "host")) == (0, 0)
    assert got == uncached(engine, prompt, 6)


def test_pinned_pages_go_out_and_back_a_group_at_a_time(model_dir):
    """Steps.read_pages and write_pinned take PINNED_GROUP (8) pages a call: 11 pages (a group of
    8, then 3 padded to 4) read into pinned host memory and written back in reverse order land
    where they were sent, and the pool's other pages stay as they were."""
    from tidejax.runtime.runner import pinned_pages

    engine = tidejax.load(model_dir, engine=ENGINE)
    serve(engine, ids(0, 80), 2)  # 10 pages of rows, page to page unlike
    runner = engine.runner
    steps, pool = runner.model.steps, runner.state.cache.pages
    before = [np.array(leaf) for leaf in jax.tree.leaves(pool)]  # copies: the write donates
    pages = list(range(11))
    rows = parallel.to_pinned(steps.read_pages(pool, pages), pinned_pages(runner.model,
                                                                           runner.state))
    assert len(rows) == 11 and all(leaf.sharding.memory_kind == "pinned_host"
                                   for leaf in jax.tree.leaves(rows))
    after = jax.tree.leaves(steps.write_pinned(pool, pages[::-1], rows))
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(np.asarray(new)[:11], old[:11][::-1])
        np.testing.assert_array_equal(np.asarray(new)[11:], old[11:])
