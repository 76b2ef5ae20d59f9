"""The disk tier under the host pool (residency.host_budget_experts): on a tiny Qwen3-MoE written
by transformers (2 MoE layers x 8 experts), a bank of a quarter of the experts and a host cache of
half. `exact` over the disk tier equals all-in-host, reading rows; `cpu` and `auto` compute their
host picks of rows on disk from rows read in the step, the same bits as all in host memory;
`substitute` reads only what the planner asks for; two devices splitting "tensor" read each
shard's slice; a checkpoint file changed or cut short while served is refused naming it; the
prepared copy (experts held bf16 from a float32 checkpoint) is written once, reused across a
restart and rebuilt when its source changes."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import tidejax
from tidejax.checkpoint.safetensors_io import SafetensorsFile
from tidejax.errors import CheckpointError, ConfigError
from tidejax.checkpoint.direct import ALIGN, DirectFile
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
def engine(tmp_path_factory):
    """The engine section of every load here: one compile cache, so the engines of a shape
    compile it once (the killed process's steps are the prepared copy test's)."""
    return {**ENGINE, "compile_cache": str(tmp_path_factory.mktemp("jit"))}


@pytest.fixture(scope="module")
def all_in_host(checkpoint, engine):
    """Every expert in host memory: a host_budget_gib above the experts' bytes (the pool read
    whole after the header checks, as without a host budget)."""
    full = tidejax.load(checkpoint, engine=engine, residency={"host_budget_gib": 1.0})
    assert full.residency.cache is None and full.residency.host_capacity == ROWS
    return full, served_greedy(full, PROMPT, 12), full.logits(PROMPT)


def _load(path, engine, **residency):
    return tidejax.load(path, engine=engine, residency={**TIERS, **residency})


@pytest.fixture(scope="module")
def over_disk(checkpoint, engine):
    """Drains every 2 steps, the host prefetch taking any row busier than a held one."""
    return _load(checkpoint, engine, miss_policy="exact", drain_every=2, hysteresis=1.0)


def test_exact_over_disk_equals_all_in_host(over_disk, all_in_host):
    full, tokens, logits = all_in_host
    n_moe, n_experts = full.family.expert_dims(full.cfg)[:2]
    assert n_moe * n_experts == ROWS
    engine = over_disk
    assert engine.residency.disk_rows.where == "checkpoint"  # float32 as stored: in place
    assert engine.residency.disk_rows.direct  # with O_DIRECT (ext4; tmpfs from Linux 6.6)
    assert served_greedy(engine, PROMPT, 12) == tokens
    cache = engine.residency.cache
    cache.wait(cache.reading())  # the reads still going on land before the next forward
    np.testing.assert_array_equal(engine.logits(PROMPT), logits)
    stats = engine.residency.stats()
    assert stats["host_resident"] == ROWS // 2 and stats["host_held"] <= ROWS // 2
    assert stats["disk_reads"] > 0 and stats["disk_read_bytes"] > 0
    assert stats["disk_read_bytes"] == stats["disk_reads"] * engine.residency.row_bytes
    assert 0 < stats["host_cold_share_total"] <= stats["cold_share_total"]
    # the host prefetch read rows off the steps' path, and later steps found them in host memory
    assert stats["disk_prefetches"] > 0 and stats["host_prefetch_hits"] > 0
    assert stats["disk_reads"] > stats["disk_reads_in_step"] and stats["disk_read_gbps"] > 0
    assert stats["disk_direct"] == 1
    shown = Metrics().render(LocalEngineClient(engine).stats(), 0)
    for key in ("disk_reads", "disk_read_bytes", "disk_read_seconds", "host_cold_share_total",
                "cold_share_total", "disk_prefetches", "host_prefetch_hits", "disk_read_gbps",
                "disk_reads_queued"):
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


def test_ring_over_disk_copies_from_host_memory_and_reads_the_rest_off_the_step(
        checkpoint, engine, all_in_host):
    """`ring` with a ring slot for every expert outside the bank: a step copies only rows in
    host memory and never waits for the disk; the misses on disk are read by the host beside
    the steps, so after a few forwards the ring holds every miss and the logits are exact's."""
    ring = _load(checkpoint, engine, miss_policy="ring", ring_slots=ROWS - ROWS // 4,
                 drain_every=1000)
    want, stats, cache = all_in_host[2], ring.residency.stats, ring.residency.cache
    first = ring.logits(PROMPT)
    assert stats()["misses"] > 0 and not np.allclose(first, want, atol=1e-5)
    # The host holds the bank's 4 rows and 4 more, so the 12 others reach the ring 4 at a time:
    # a round's rows, read after a forward missed them, land before the next, which chooses
    # them; the one after fetches them, pinned in host memory till then (the next round's reads
    # meanwhile dropped), and writes them into ring slots as the next round's reads land. So 2
    # forwards a round, 3 rounds, and one more that misses nothing (6 here: 8 allows slack).
    rounds = -(-(ROWS - ROWS // 4) // (ROWS // 2 - ROWS // 4))
    for _ in range(2 * rounds + 2):  # until a forward misses nothing
        cache.wait(cache.reading())  # the reads queued land first: not the disk's speed
        misses = stats()["misses"]
        got = ring.logits(PROMPT)
        if stats()["misses"] == misses:
            break
    assert stats()["misses"] == misses and stats()["ring_hits"] > 0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    after = stats()
    assert after["disk_prefetches"] > 0 and after["disk_reads_in_step"] == 0
    assert after["disk_read_waits_in_step"] == 0
    # the boot's (the bank's rows: no history) and the reads ahead, nothing else
    assert after["disk_reads"] <= ROWS // 4 + after["disk_prefetches"]


def test_a_peers_cache_obeys_process_0s_orders_and_holds_its_map(checkpoint, engine, tmp_path,
                                                                   caplog):
    """What a peer's host cache does with process 0's plans (across two processes:
    tests/distributed/test_disk_tier.py): the reads process 0 queued are queued there too and
    taken when the map places their rows (each row read once), a held row overwritten only after
    the steps in flight, the same rows in the same slots; a dropped row is dropped there; a read
    that fails is read once more, and a second failure raises naming the file before any slot
    changes."""
    folder = shutil.copytree(checkpoint, tmp_path / "ckpt")
    rows = _load(folder, engine, miss_policy="exact").residency.disk_rows
    leader, peer = HostCache(rows, 3), HostCache(rows, 3)
    leader.orders = []
    for cache in leader, peer:
        cache.fill([0, 1, 2])
    demand = np.arange(ROWS, dtype=np.float64)
    leader.request([9, 10])
    leader.wait([9, 10])
    assert leader.commit(demand, pinned=[0], protect=(), wait_steps=lambda: None)
    peer.obey(leader.take_orders())
    waited = []
    assert peer.follow(leader.slot_of, lambda: waited.append(1)) and waited
    assert list(peer.row_at) == list(leader.row_at) == [0, 10, 9]
    for name, leaf in peer.pool.items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(leader.pool[name]))
    assert peer.stats()["disk_reads"] == leader.stats()["disk_reads"] == 5
    assert not peer.follow(leader.slot_of, lambda: None)  # the same map: nothing to do
    for cache in leader, peer:  # an in-step read (`exact`) on each, of less demand than any row
        cache.read_now(3)
    leader.commit(demand, pinned=[0], protect=(), wait_steps=lambda: None)
    assert leader.take_orders() == [("drop", [3])]
    peer.obey([("drop", [3])])
    assert peer.reading() == set()
    _damage(folder / "model.safetensors", "truncated")
    peer.obey([("read", [11])])  # fails in the reading thread, then once more in follow
    moved = peer.slot_of.copy()
    moved[11], moved[9] = moved[9], -1
    before = {name: np.asarray(leaf).copy() for name, leaf in peer.pool.items()}
    with pytest.raises(CheckpointError, match="truncated since it was opened"):
        peer.follow(moved, lambda: None)
    assert "reading expert row 11 failed" in caplog.text
    assert list(peer.row_at) == [0, 10, 9] and peer.slot_of[11] == -1
    for name, leaf in peer.pool.items():
        np.testing.assert_array_equal(np.asarray(leaf), before[name])


def _in_host_and_over_disk(checkpoint, engine, **residency):
    """The same residency with every expert in host memory and with half of them on disk,
    adaptation off in both: the same bank, so the host kernel's part of each output is the same
    picks'."""
    frozen = {**residency, "adapt": False}
    return (_load(checkpoint, engine, host_budget_experts=0, host_budget_gib=1.0, **frozen),
            _load(checkpoint, engine, **frozen))


def test_cpu_over_disk_equals_all_in_host_cpu(checkpoint, engine, all_in_host):
    """`cpu` over the disk tier: a miss of a row on disk waits in its step for the read and is
    computed by the host kernel from it, the same bits as with every expert in host memory;
    each such pick counted (cpu_disk_picks: in the callback; host_misses: from the step's miss
    tally and the map it ran on)."""
    in_host, over = _in_host_and_over_disk(checkpoint, engine, miss_policy="cpu")
    assert in_host.residency.cache is None and over.residency.cpu.disk is over.residency.cache
    tokens = served_greedy(in_host, PROMPT, 12)
    assert served_greedy(over, PROMPT, 12) == tokens == all_in_host[1]  # and `exact`'s
    logits = over.logits(PROMPT)
    np.testing.assert_array_equal(logits, in_host.logits(PROMPT))
    np.testing.assert_allclose(logits, all_in_host[2], rtol=0, atol=1e-4)  # float32 rounding
    over.residency.flush()
    stats = over.residency.stats()
    assert stats["cpu_picks"] == stats["misses"] > 0  # every miss computed on the host
    assert stats["cpu_disk_picks"] == stats["host_misses"] > 0
    assert stats["disk_reads_in_step"] + stats["disk_read_waits_in_step"] > 0
    assert stats["disk_reads"] > ROWS // 4  # the bank's rows at boot, then the misses'
    assert in_host.residency.stats()["cpu_disk_picks"] == 0
    shown = Metrics().render(LocalEngineClient(over).stats(), 0)
    assert f"tidejax_residency_cpu_disk_picks {stats['cpu_disk_picks']}" in shown


def test_auto_over_disk_reads_the_picks_it_sends_to_the_host(checkpoint, engine):
    """`auto` over the disk tier: the heavy misses go to the host, those of rows on disk read
    in their step (counted), the light ones substituted, the same bits as all in host memory."""
    in_host, over = _in_host_and_over_disk(checkpoint, engine, miss_policy="auto",
                                           exact_weight=0.3)
    logits = over.logits(PROMPT)
    np.testing.assert_array_equal(logits, in_host.logits(PROMPT))
    over.residency.flush()
    stats, want = over.residency.stats(), in_host.residency.stats()
    assert 0 < stats["cpu_picks"] == want["cpu_picks"] < stats["misses"]
    assert 0 < stats["cpu_disk_picks"] < stats["host_misses"]  # light ones on disk: substituted
    assert stats["approx_weight_share_total"] == want["approx_weight_share_total"] > 0
    assert stats["disk_reads_in_step"] + stats["disk_read_waits_in_step"] > 0


@pytest.mark.parametrize("residency, message", [
    ({"host_budget_experts": ROWS // 4}, "more than the bank's 4 experts"),
    ({"budget_experts": 0}, "set budget_experts or budget_gib"),
    ({"host_budget_gib": 0.5}, "or host_budget_gib, not both")])
def test_budgets_and_policies_the_disk_tier_refuses(checkpoint, engine, residency, message):
    with pytest.raises(ConfigError, match=f"host_budget_experts.*{message}"):
        _load(checkpoint, engine, **residency)


def test_substitute_reads_only_what_the_planner_asks(checkpoint, engine, over_disk, tmp_path):
    """Then, with the history saved, a restart needs no calibration: the host cache (given in
    GiB) is filled with the bank's experts and the busiest others, and nothing else is read."""
    state = {"state_dir": str(tmp_path / "state")}
    first = _load(checkpoint, engine, miss_policy="substitute", drain_every=4, **state)
    residency = first.residency
    residency.freeze()
    before = residency.stats()
    served_greedy(first, PROMPT, 8)
    frozen = residency.stats()
    assert frozen["host_misses"] > before["host_misses"]  # misses of rows on disk, served...
    assert frozen["disk_reads"] == before["disk_reads"]  # ...without reading them
    residency.unfreeze()
    served_greedy(first, PROMPT, 16)
    after = residency.stats()
    # a planned swap reads its row at most once while it waits in the queue, a prefetch once
    assert (after["disk_reads"] - frozen["disk_reads"]
            <= after["swaps_planned"] + after["disk_prefetches"])
    assert after["host_held"] <= ROWS // 2
    first.close()
    gib = (ROWS // 2) * over_disk.residency.row_bytes / 2**30
    again = tidejax.load(checkpoint, engine=engine, residency={
        "budget_experts": ROWS // 4, "host_budget_gib": gib, "miss_policy": "substitute",
        **state})
    assert not again.residency.needs_calibration
    stats = again.residency.stats()
    assert stats["host_resident"] == ROWS // 2 and stats["disk_reads"] == ROWS // 2


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
def test_a_changed_checkpoint_is_refused_naming_it(checkpoint, engine, tmp_path, how):
    folder = shutil.copytree(checkpoint, tmp_path / "ckpt")
    served = _load(folder, engine, miss_policy="exact")
    _damage(folder / "model.safetensors", how)
    with pytest.raises(Exception, match=f"{folder / 'model.safetensors'}: {how} since it was "
                                        f"opened"):
        for _ in range(4):  # until a miss of a row on disk
            served.logits(np.random.RandomState(len(how)).randint(3, 256, 32))
            served.residency.freeze()


def test_prepared_copy_rebuilt_when_its_checkpoint_changes(checkpoint, engine, tmp_path):
    folder = shutil.copytree(checkpoint, tmp_path / "ckpt")
    options = dict(miss_policy="exact", state_dir=str(tmp_path / "state"))

    def load():
        return tidejax.load(folder, engine=engine, model={"experts": "bf16"},
                            residency={**TIERS, **options})

    first = load()
    rows = first.residency.disk_rows
    assert rows.where == "prepared" and rows.path.parent == tmp_path / "state" / "experts"
    assert rows.stride % ALIGN == 0 and rows.direct
    written = os.stat(rows.path)
    logits = first.logits(PROMPT)
    assert first.residency.stats()["disk_direct"] == 1
    first.close()
    # (a restart reuses the copy as it is: test_killed_while_reading_restarts_on_the_same_state_dir)
    _damage(folder / "model.safetensors", "changed")
    rebuilt = load()
    assert os.stat(rows.path).st_ino != written.st_ino  # written anew, renamed over
    reference = tidejax.load(folder, engine=engine, model={"experts": "bf16"})
    changed = reference.logits(PROMPT)
    assert not np.array_equal(changed, logits)
    np.testing.assert_array_equal(rebuilt.logits(PROMPT), changed)


def test_a_cut_prepared_copy_is_rebuilt_at_start_and_refused_while_served(checkpoint, engine,
                                                                         tmp_path):
    options = dict(miss_policy="exact", state_dir=str(tmp_path / "state"))
    served = tidejax.load(checkpoint, engine=engine, model={"experts": "bf16"},
                          residency={**TIERS, **options})
    rows = served.residency.disk_rows
    os.truncate(rows.path, rows.stride * (ROWS - 1))
    with pytest.raises(CheckpointError, match=f"{rows.path}: truncated since it was opened"):
        rows.read(0)
    cache, refused = HostCache(rows, ROWS // 2), f"{rows.path}: truncated"
    cache.request([0, 1])
    with pytest.raises(CheckpointError, match=refused):
        cache.read_now(0)  # waits for the queued read, which failed
    with pytest.raises(CheckpointError, match=refused):
        cache.wait([1])
    demand = np.ones(ROWS)
    with pytest.raises(CheckpointError, match=refused):
        cache.commit(demand, pinned=(), protect=(), wait_steps=lambda: None)
    # each failed read raised once: nothing is left to raise again, and a row is read anew
    assert cache.queued == 0 and not cache.commit(demand, (), (), lambda: None)
    served.close()
    again = tidejax.load(checkpoint, engine=engine, model={"experts": "bf16"},
                         residency={**TIERS, **options})
    assert os.path.getsize(again.residency.disk_rows.path) == rows.stride * ROWS


def test_direct_reads_fall_back_to_buffered_where_refused(tmp_path, monkeypatch, caplog):
    """A filesystem that refuses O_DIRECT (EINVAL at open, as tmpfs before Linux 6.6) is read
    buffered, said once; the bytes are the file's either way, at an aligned address."""
    data = np.random.RandomState(0).randint(0, 256, 3 * ALIGN + 100).astype(np.uint8)
    path = tmp_path / "rows"
    data.tofile(path)
    direct = DirectFile(path)
    assert direct.direct
    read = direct.read(ALIGN, 2 * ALIGN + 100)
    np.testing.assert_array_equal(read, data[ALIGN:])
    assert read.ctypes.data % ALIGN == 0
    plain_open = os.open

    def refusing(name, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(name))
        return plain_open(name, flags, *args)

    monkeypatch.setattr(os, "open", refusing)
    with caplog.at_level("WARNING", "tidejax.residency"):
        buffered = DirectFile(path)
        np.testing.assert_array_equal(buffered.read(0, 3 * ALIGN + 100), data)
        buffered.read(ALIGN, 10)
    assert not buffered.direct
    assert [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()] == [
        f"residency: {path} refuses O_DIRECT (Invalid argument); its rows are read buffered, "
        f"through the page cache"]
    with pytest.raises(CheckpointError, match=f"{path}: truncated"):
        buffered.read(3 * ALIGN, ALIGN)


TWO_DEVICES = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
import numpy as np
import tidejax
from tidejax.residency.pool import pool_layout
from tests.support.tiny_models import served_greedy


def ring_against(want):
    # `ring` on the same mesh, a ring slot for every row outside the bank: forwards until one
    # misses nothing (the reads queued landing between them); its logits' distance to `want`
    ring = tidejax.load(sys.argv[1], engine={engine}, residency={ring},
                        distributed={{"tensor_parallel": 2}})
    cache, stats = ring.residency.cache, ring.residency.stats
    for _ in range(8):
        cache.wait(cache.reading())
        misses = stats()["misses"]
        got = ring.logits({prompt})
        if stats()["misses"] == misses:
            break
    return {{"error": float(np.abs(got - want).max()), "stats": stats()}}


split = tidejax.load(sys.argv[1], engine={engine}, residency={residency},
                     distributed={{"tensor_parallel": 2}})
tokens = served_greedy(split, {prompt}, 12)
cache = split.residency.cache
held = [(slot, int(row)) for slot, row in enumerate(cache.row_at) if row >= 0]
experts = split.state.experts  # the steps' (donated) state: the cache's pool in place
pool = {{k: np.asarray(v) for k, v in experts.pool.items()}}  # every shard's slice, gathered
print(json.dumps({{
    "tokens": tokens, "stats": split.residency.stats(),
    "pool": list(experts.pool["gate_up"].sharding.spec),
    "bank": list(experts.bank["gate_up"].sharding.spec),
    "shards": len(experts.pool["gate_up"].addressable_shards),
    "held": len(held),
    "rows_as_loaded": all(np.array_equal(pool[k][slot], v)
                          for slot, row in held
                          for k, v in pool_layout(cache.rows.read(row), 2).items()),
    "ring": ring_against(split.logits({prompt}))}}))
"""


def test_a_mesh_that_splits_tensor_reads_each_shards_slice(tiny_checkpoint, engine):
    """Two devices in one process (distributed.tensor_parallel 2): each host slot split as the
    loaded pool is (each device's slice of every row's intermediate, gate_up interleaved by
    tensor block), rows read from disk into both shards and, for `exact`'s misses, inside the
    step; the greedy tokens of one device with every expert in host memory. `ring` on the same
    mesh reads its misses on disk beside the steps and scores as `exact` once they are in."""
    # two KV heads, one a device
    checkpoint = tiny_checkpoint("qwen3_moe", "dense_first", num_hidden_layers=3,
                                 num_key_value_heads=2)
    one = tidejax.load(checkpoint, engine=engine, residency={"host_budget_gib": 1.0})
    residency = {**TIERS, "miss_policy": "exact", "drain_every": 2, "hysteresis": 1.0}
    ring = {**TIERS, "miss_policy": "ring", "ring_slots": ROWS - ROWS // 4, "drain_every": 1000}
    code = TWO_DEVICES.format(engine=engine, residency=residency, ring=ring,
                              prompt=PROMPT.tolist())
    out = subprocess.run([sys.executable, "-c", code, str(checkpoint)], capture_output=True,
                         text=True, cwd=os.getcwd(), timeout=600,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tokens"] == served_greedy(one, PROMPT, 12)
    assert got["pool"] == got["bank"] == [None, "tensor"] and got["shards"] == 2
    assert got["held"] > ROWS // 4 and got["rows_as_loaded"]
    stats = got["stats"]
    assert stats["disk_reads"] > ROWS // 4 and stats["host_misses"] > 0
    assert stats["disk_reads_in_step"] + stats["disk_read_waits_in_step"] > 0
    # `ring`: its misses on disk read beside the steps into both shards, copied into the ring,
    # until it scores as `exact` on the same mesh
    ring = got["ring"]["stats"]
    assert got["ring"]["error"] <= 1e-5 and ring["ring_hits"] > 0 and ring["disk_prefetches"] > 0
    assert ring["disk_reads_in_step"] == ring["disk_read_waits_in_step"] == 0


KILLED = """
import sys, numpy as np, tidejax
from tests.support.tiny_models import served_greedy
engine = tidejax.load(sys.argv[1], engine={engine}, model={{"experts": "bf16"}},
                      residency={residency})
while True:  # serves until killed: reads and saves (drain_every 1) all along
    print(served_greedy(engine, {prompt}, 6), engine.residency.stats()["disk_reads"], flush=True)
"""


def test_killed_while_reading_restarts_on_the_same_state_dir(checkpoint, engine, tmp_path):
    """A server process killed with SIGKILL while it reads rows and saves its state: a restart
    on the same state_dir reuses the prepared copy (nothing half-written taken for whole) and
    serves the same greedy tokens."""
    residency = {**TIERS, "miss_policy": "exact", "drain_every": 1, "hysteresis": 1.0,
                 "state_dir": str(tmp_path / "state")}
    code = KILLED.format(engine=engine, residency=residency, prompt=PROMPT.tolist())
    child = subprocess.Popen([sys.executable, "-c", code, str(checkpoint)],
                             stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        lines = [child.stdout.readline() for _ in range(2)]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    tokens, reads = lines[0].rsplit(" ", 1)
    assert int(lines[-1].rsplit(" ", 1)[1]) > int(reads)  # it was reading all along
    copy = next((tmp_path / "state" / "experts").glob("*.rows"))
    inode = os.stat(copy).st_ino
    again = tidejax.load(checkpoint, engine=engine, model={"experts": "bf16"},
                         residency=residency)
    assert again.residency.disk_rows.path == copy and os.stat(copy).st_ino == inode  # reused
    assert str(served_greedy(again, PROMPT, 6)) == tokens
