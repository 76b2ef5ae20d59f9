"""The disk tier under the host pool (residency.host_budget_experts): on a tiny Qwen3-MoE written
by transformers (2 MoE layers x 8 experts), a bank of a quarter of the experts and a host cache of
half. `exact` over the disk tier equals all-in-host, reading rows; `substitute` reads only what
the planner asks for; a checkpoint file changed or cut short while served is refused naming it;
the prepared copy (experts held bf16 from a float32 checkpoint) is written once, reused across a
restart and rebuilt when its source changes."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import tidejax
from tidejax.checkpoint.safetensors_io import SafetensorsFile
from tidejax.errors import CheckpointError, ConfigError
from tidejax.residency.hostcache import HostCache
from tidejax.runtime.client import LocalEngineClient
from tidejax.server.metrics import Metrics
from tests.support.tiny_models import served_greedy

PROMPT = np.random.RandomState(11).randint(3, 256, 24)
ENGINE = {"max_context": 64, "lanes": 1}
ROWS = 16  # 2 MoE layers x 8 experts
TIERS = {"budget_experts": ROWS // 4, "host_budget_experts": ROWS // 2}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe", "dense_first", num_hidden_layers=3)


@pytest.fixture(scope="module")
def all_in_host(checkpoint):
    engine = tidejax.load(checkpoint, engine=ENGINE)
    return engine, served_greedy(engine, PROMPT, 12), engine.logits(PROMPT)


def _load(path, **residency):
    return tidejax.load(path, engine=ENGINE, residency={**TIERS, **residency})


@pytest.fixture(scope="module")
def over_disk(checkpoint):
    return _load(checkpoint, miss_policy="exact")


def test_exact_over_disk_equals_all_in_host(over_disk, all_in_host):
    full, tokens, logits = all_in_host
    n_moe, n_experts = full.family.expert_dims(full.cfg)[:2]
    assert n_moe * n_experts == ROWS
    engine = over_disk
    assert engine.residency.disk_rows.where == "checkpoint"  # float32 as stored: in place
    assert served_greedy(engine, PROMPT, 12) == tokens
    np.testing.assert_array_equal(engine.logits(PROMPT), logits)
    stats = engine.residency.stats()
    assert stats["host_resident"] == ROWS // 2 and stats["host_held"] <= ROWS // 2
    assert stats["disk_reads"] > 0 and stats["disk_read_bytes"] > 0
    assert stats["disk_read_bytes"] == stats["disk_reads"] * engine.residency.row_bytes
    assert 0 < stats["host_cold_share_total"] <= stats["cold_share_total"]
    shown = Metrics().render(LocalEngineClient(engine).stats(), 0)
    for key in ("disk_reads", "disk_read_bytes", "disk_read_seconds", "host_cold_share_total",
                "cold_share_total"):
        assert f"tidejax_residency_{key} {stats[key]}" in shown


def test_commit_evicts_the_least_demanded_row_the_bank_does_not_hold(over_disk):
    rows = over_disk.residency.disk_rows
    cache = HostCache(rows, 3)
    cache.fill([0, 1, 2])
    demand = np.arange(ROWS, dtype=np.float64)
    demand[1] = 100.0  # row 0 (least demand) is in the bank: row 2 goes
    cache.request([9])
    cache.wait([9])
    waited = []
    assert cache.commit(demand, pinned=[0], protect=(), wait_steps=lambda: waited.append(1))
    assert waited and cache.slot_of[9] == 2 and cache.slot_of[2] == -1
    assert cache.slot_of[0] == 0 and cache.slot_of[1] == 1
    for name, leaf in cache.pool.items():
        np.testing.assert_array_equal(np.asarray(leaf)[2], rows.read(9)[name])
    cache.read_now(3)  # less demand than any row it could take the place of: dropped
    assert cache.commit(demand, pinned=[0], protect=(), wait_steps=lambda: None)
    assert cache.slot_of[3] == -1 and cache.stats()["host_reads_dropped"] == 1
    cache.read_now(4)  # unless a queued swap wants it
    cache.commit(demand, pinned=[0], protect=[4], wait_steps=lambda: None)
    assert cache.slot_of[4] >= 0 and cache.stats()["host_evictions"] == 2
    assert cache.stats()["disk_reads"] == 6


@pytest.mark.parametrize("residency, message", [
    ({"host_budget_experts": ROWS // 4}, "more than the bank's 4 experts"),
    ({"miss_policy": "ring", "ring_slots": 2}, "miss_policy 'ring' over the disk tier"),
    ({"budget_experts": 0}, "set budget_experts or budget_gib")])
def test_budgets_and_policies_the_disk_tier_refuses(checkpoint, residency, message):
    with pytest.raises(ConfigError, match=f"host_budget_experts.*{message}"):
        _load(checkpoint, **residency)


def test_substitute_reads_only_what_the_planner_asks(checkpoint):
    engine = _load(checkpoint, miss_policy="substitute", drain_every=4)
    residency = engine.residency
    residency.freeze()
    before = residency.stats()
    served_greedy(engine, PROMPT, 8)
    frozen = residency.stats()
    assert frozen["host_misses"] > before["host_misses"]  # misses of rows on disk, served...
    assert frozen["disk_reads"] == before["disk_reads"]  # ...without reading them
    residency.unfreeze()
    served_greedy(engine, PROMPT, 16)
    after = residency.stats()
    # a planned swap reads its row at most once while it waits in the queue, a prefetch once
    assert (after["disk_reads"] - frozen["disk_reads"]
            <= after["swaps_planned"] + after["disk_prefetches"])
    assert after["host_held"] <= ROWS // 2


def test_boot_reads_what_the_budgets_keep(checkpoint, tmp_path):
    """With a saved history the boot map needs no calibration: the host cache is filled with
    the bank's experts and the busiest others, and nothing else is read."""
    state = {"state_dir": str(tmp_path / "state")}
    first = _load(checkpoint, miss_policy="substitute", **state)
    served_greedy(first, PROMPT, 4)
    first.close()
    second = _load(checkpoint, miss_policy="substitute", **state)
    assert second.residency.stats()["disk_reads"] == ROWS // 2


def _damage(path, how: str) -> None:
    """Cuts the checkpoint short, or changes the bytes of its first routed-expert tensor."""
    if how == "truncated":
        os.truncate(path, os.path.getsize(path) - 64)
        return
    info = next(t for n, t in SafetensorsFile(path).tensors.items() if ".experts." in n)
    with open(path, "r+b") as f:
        f.seek(info.begin)
        data = bytearray(f.read(info.nbytes))
        f.seek(info.begin)
        f.write(bytes(b ^ 0x40 for b in data))
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))


@pytest.mark.parametrize("how", ["truncated", "changed"])
def test_a_changed_checkpoint_is_refused_naming_it(checkpoint, tmp_path, how):
    folder = shutil.copytree(checkpoint, tmp_path / "ckpt")
    engine = _load(folder, miss_policy="exact")
    _damage(folder / "model.safetensors", how)
    with pytest.raises(Exception, match=f"{folder / 'model.safetensors'}: {how} since it was "
                                        f"opened"):
        for _ in range(4):  # until a miss of a row on disk
            engine.logits(np.random.RandomState(len(how)).randint(3, 256, 32))
            engine.residency.freeze()


def test_prepared_copy_reused_and_rebuilt(checkpoint, tmp_path):
    folder = shutil.copytree(checkpoint, tmp_path / "ckpt")
    options = dict(miss_policy="exact", state_dir=str(tmp_path / "state"))

    def load():
        return tidejax.load(folder, engine=ENGINE, model={"experts": "bf16"},
                            residency={**TIERS, **options})

    first = load()
    rows = first.residency.disk_rows
    assert rows.where == "prepared" and rows.path.parent == tmp_path / "state" / "experts"
    written = os.stat(rows.path)
    logits = first.logits(PROMPT)
    first.close()

    again = load()  # a restart reuses the copy as it is
    assert again.residency.disk_rows.path == rows.path
    assert os.stat(rows.path).st_ino == written.st_ino
    assert os.stat(rows.path).st_mtime_ns == written.st_mtime_ns
    np.testing.assert_array_equal(again.logits(PROMPT), logits)
    again.close()

    _damage(folder / "model.safetensors", "changed")
    rebuilt = load()
    assert os.stat(rows.path).st_ino != written.st_ino  # written anew, renamed over
    reference = tidejax.load(folder, engine=ENGINE, model={"experts": "bf16"})
    changed = reference.logits(PROMPT)
    assert not np.array_equal(changed, logits)
    np.testing.assert_array_equal(rebuilt.logits(PROMPT), changed)


def test_a_cut_prepared_copy_is_rebuilt_at_start_and_refused_while_served(checkpoint, tmp_path):
    options = dict(miss_policy="exact", state_dir=str(tmp_path / "state"))
    engine = tidejax.load(checkpoint, engine=ENGINE, model={"experts": "bf16"},
                          residency={**TIERS, **options})
    rows = engine.residency.disk_rows
    os.truncate(rows.path, rows.stride * (ROWS - 1))
    with pytest.raises(CheckpointError, match=f"{rows.path}: truncated since it was opened"):
        rows.read(0)
    engine.close()
    again = tidejax.load(checkpoint, engine=ENGINE, model={"experts": "bf16"},
                         residency={**TIERS, **options})
    assert os.path.getsize(again.residency.disk_rows.path) == rows.stride * ROWS
