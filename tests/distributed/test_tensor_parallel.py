"""Tensor parallelism (tidejax.parallel's mesh, tidejax.distributed, tidejax.distributed.peer):
the gate_up layout a split needs; a 4-device CPU mesh in one process (the sharding table: heads,
intermediates, bank and pool split; greedy tokens and `exact` swaps as on one device); two
processes on loopback serving the demo model as one (openai client on process 0, tokens as one
process's); the boot guard refusing a differing setting or checkpoint, naming it; the
[distributed] table's checks."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import tidejax
from tidejax import distributed, parallel
from tidejax.config import EngineConfig, parse_set
from tidejax.contract import interleave_gate_up
from tidejax.errors import ConfigError
from tests.support.server_fixtures import (REPO, free_coordinator, free_port, launch_server,
                                           server_log, start_peer, stop_server, write_profile)

DEMO = REPO / "models" / "demo"
ENGINE = {"lanes": 2, "max_context": 32, "page_size": 32, "prefill_chunk": 16}
PROMPT = "The quick brown fox"
NEW_TOKENS = 6


def test_gate_up_interleaved_by_tensor_block_keeps_each_shard_gate_then_up():
    """Each of T contiguous blocks of the interleaved rows is one device's bank row in the
    checkpoint's layout: its I/T gate rows, then the same units' up rows."""
    inter, t = 8, 2
    gate, up = np.arange(inter)[:, None] * [1, 1], 100 + np.arange(inter)[:, None] * [1, 1]
    row = {"gate_up": np.concatenate([gate, up]), "down": np.zeros((2, inter))}
    out = interleave_gate_up(row, t)["gate_up"]
    for block, shard in enumerate(np.split(out, t)):
        units = slice(block * inter // t, (block + 1) * inter // t)
        np.testing.assert_array_equal(shard, np.concatenate([gate[units], up[units]]))
    np.testing.assert_array_equal(interleave_gate_up(row, 1)["gate_up"], row["gate_up"])
    with pytest.raises(ValueError, match="not a multiple of distributed.tensor_parallel = 3"):
        interleave_gate_up(row, 3)


def test_one_device_keeps_one_code_path():
    """On a 1x1 mesh the kernel seams are the functions themselves (no shard_map)."""
    def fn(x):
        return (x,)
    assert parallel.over_tensor(fn, (None,), ("sum",)) is fn
    assert parallel.tensor_size() == 1


FOUR_DEVICES = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import numpy as np
    import tidejax
    from tidejax import parallel
    from tidejax.errors import ConfigError
    from tidejax.runtime.scheduler import GenerationRequest, TokenEvent

    def run(tensor, **residency):
        engine = tidejax.load(sys.argv[1], engine=json.loads(sys.argv[2]), residency=residency,
                              distributed={"tensor_parallel": tensor})
        ids = engine.tokenizer.encode(sys.argv[3])
        events = [[], []]
        for lane, prompt in enumerate((ids, ids[1:])):
            engine.scheduler.submit(GenerationRequest(prompt, int(sys.argv[4]), ignore_eos=True),
                                    events[lane].append)
        engine.scheduler.run_until_idle()
        tokens = [[e.token_id for e in lane if isinstance(e, TokenEvent)] for lane in events]
        return engine, tokens

    try:
        run(4, budget_experts=72, miss_policy="cpu")
    except ConfigError as e:
        cpu_refused = str(e)
    one, one_tokens = run(1)
    four, four_tokens = run(4, budget_experts=72, miss_policy="exact")
    # the one-device engine, after the four-device one loaded and ran: still on its own mesh
    one_text = one.generate(sys.argv[3], max_new_tokens=int(sys.argv[4]))
    try:  # an MXFP4 expert of one 32-wide block, split 4 ways
        parallel.put({"down_scales": np.zeros((8, 1, 16))}, {"down_scales": (None, "ffw", None)},
                     four.loaded.mesh)
    except ConfigError as e:
        split_refused = str(e)
    params = four.loaded.params["layers_1"]["attn"]
    experts = four.state.experts
    print(json.dumps({
        "one": one_tokens, "four": four_tokens, "one_text": one_text,
        "meshes": [dict(one.loaded.mesh.shape), dict(four.loaded.mesh.shape),
                   dict(parallel.current_mesh().shape)],
        "one_state": sorted({len(leaf.sharding.device_set) for leaf in jax.tree.leaves(one.state)}),
        "q_b_proj": list(params["q_b_proj"]["weight"].sharding.spec),
        "o_proj": list(params["o_proj"]["weight"].sharding.spec),
        "bank": list(experts.bank["gate_up"].sharding.spec),
        "pool": list(experts.pool["gate_up"].sharding.spec),
        "pool_memory": experts.pool["gate_up"].sharding.memory_kind,
        "latent": list(four.state.cache.pages.latent[0].sharding.spec),
        "stats": {k: int(v) for k, v in four.residency.stats().items()
                  if k in ("misses", "swaps_applied", "resident", "experts")},
        "cpu_refused": cpu_refused,
        "split_refused": split_refused,
        "compiles": [one.loaded.steps.step.jitted._cache_size(),
                     four.loaded.steps.step.jitted._cache_size()],
    }))
""")


@pytest.fixture(scope="module")
def four_devices() -> dict:
    """FOUR_DEVICES's report: one device's greedy tokens (and text) beside a 4-device mesh's."""
    out = subprocess.run(
        [sys.executable, "-c", FOUR_DEVICES, str(DEMO), json.dumps(ENGINE), PROMPT,
         str(NEW_TOKENS)], capture_output=True, text=True, cwd=REPO, timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-4000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "log": out.stderr}


def test_a_four_device_mesh_splits_by_the_table_and_serves_as_one_device(four_devices):
    """Heads and every intermediate split 4 ways (MLA's latent pages whole); half the experts
    resident under `exact`, swapping, on the split bank and host pool: the greedy tokens of
    one device, all resident, and no more compilations. A leaf that does not split is refused
    naming it."""
    got = four_devices
    one, four, process = got["meshes"]
    assert four == {"data": 1, "tensor": 4}
    assert one == process == {"data": 1, "tensor": 1}  # the four-device mesh is its model's alone
    assert got["one_state"] == [1]
    assert got["q_b_proj"] == ["tensor"]  # [heads, q_lora]
    assert got["o_proj"] == [None, "tensor"]  # [embed, heads]
    assert got["bank"] == got["pool"] == [None, "tensor"]  # [N, 2I, D]
    assert got["pool_memory"] == parallel.host_memory_kind() or got["pool_memory"] == "device"
    assert got["latent"] == []
    stats = got["stats"]
    assert stats["resident"] * 2 == stats["experts"] and stats["misses"] > 0
    assert stats["swaps_applied"] > 0
    assert got["four"] == got["one"] and len(got["one"][0]) == NEW_TOKENS
    assert got["compiles"][1] == got["compiles"][0]
    assert "filled in numpy" not in got["log"]  # each device's shard of the pool filled in place
    assert "'residency.miss_policy' = 'cpu' computes misses on the host" in got["cpu_refused"]
    assert got["split_refused"] == (
        "'distributed.tensor_parallel' = 4 splits ['down_scales'] along its ffw axis "
        "(dimension 1), of 1: not a multiple of 4")


@contextlib.contextmanager
def _serving_pair(profile):
    """Process 1, then process 0 serving HTTP (its URL); SIGTERM on process 0 stops both."""
    peer = start_peer(profile)
    try:
        proc, url = launch_server(profile, "--set", "distributed.process_id=0", timeout=480)
        try:
            yield url
        finally:
            assert stop_server(proc) == 0
        assert peer.wait(timeout=60) == 0
    finally:
        peer.kill()


def _pair_profile(path, model_dir=DEMO, timeout_s: int = 120, engine=ENGINE, heartbeat_s=10,
                  **tables):
    return write_profile(path, model_dir, engine=engine, distributed={
        "num_processes": 2, "coordinator": free_coordinator(), "timeout_s": timeout_s,
        "heartbeat_s": heartbeat_s}, **tables)


def _health(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503 unless ready
        return json.loads(e.read())


def test_a_peer_that_is_gone_stops_the_pair_cleanly(tmp_path):
    """Process 1 killed while process 0 serves (idle): within distributed.heartbeat_s (2 s)
    process 0's pings find it gone, /health says "failed" naming process 1, a request gets an
    error at once; process 0 is still up after jax's heartbeat timeout has passed (it used to
    abort there, SIGABRT) and SIGTERM stops it with exit code 0."""
    profile = _pair_profile(tmp_path / "gone.toml", heartbeat_s=2)
    peer = start_peer(profile)
    try:
        proc, url = launch_server(profile, "--set", "distributed.process_id=0", timeout=480)
        try:
            assert _health(url)["status"] == "ready"
            peer.kill()
            peer.wait(timeout=30)
            deadline = time.monotonic() + 8
            while _health(url)["status"] != "failed" and time.monotonic() < deadline:
                time.sleep(0.2)
            health = _health(url)
            assert health["status"] == "failed" and "process 1 is gone" in health["reason"]
            body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 4}).encode()
            request = urllib.request.Request(url + "/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code >= 500
            time.sleep(6)  # past jax's heartbeat timeout (2 s) and its check of it
            assert proc.poll() is None
        finally:
            code = stop_server(proc)
        assert code == 0
        assert "process 1 is gone" in server_log(profile)
    finally:
        peer.kill()


def test_two_processes_serve_as_one(tmp_path, four_devices):
    """Process 0 serves HTTP and schedules, process 1 replays its steps; the mesh splits the
    demo model two ways over the processes (gloo), half its experts resident under `exact`
    (calibrated at boot: a scoring forward, then the swaps of a reseed, replayed; each process
    fills its half of the host pool in place): the openai client's greedy text is one
    process's, all resident. SIGTERM on process 0 stops both."""
    import openai
    profile = _pair_profile(tmp_path / "pair.toml",
                            residency={"budget_experts": 72, "miss_policy": "exact"})
    with _serving_pair(profile) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=300)
        reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW_TOKENS,
                                          temperature=0)
        text = reply.choices[0].text
        assert reply.usage.completion_tokens == NEW_TOKENS
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            metrics = dict(line.rsplit(" ", 1) for line in r.read().decode().splitlines()
                           if line.startswith("tidejax_residency_"))
        assert float(metrics["tidejax_residency_swaps_applied"]) > 0
        assert float(metrics["tidejax_residency_misses"]) > 0
    log = (tmp_path / "pair-peer.log").read_text()
    assert "process 1 follows process 0" in log and "process 0 stopped" in log
    assert "filled in numpy" not in log + server_log(profile)  # each its half, in place
    assert text == four_devices["one_text"]  # one process, one device


GLM_PAIR = {"lanes": 2, "max_context": 64, "page_size": 16, "prefill_chunk": 16}
GLM_PROMPTS = ["The tide comes in over the sand and", "A quick brown fox jumps over the lazy"]


def test_two_processes_preempt_and_resume_kv_pages_split_by_heads(tmp_path):
    """GLM-4.5's GQA pages split by KV head over the two processes, and a pool of 4 pages for
    two sequences that grow to 3 each: the newest is preempted (each process keeps its own
    shards of its pages) and resumes. The openai client's greedy texts are those of one process
    with room for both."""
    import openai
    model = tmp_path / "glm"
    subprocess.run([sys.executable, "-m", "tools.make_synthetic", str(model),
                    "--shape", "glm-tiny", "--layers", "3", "--experts", "bf16", "--workers", "1"],
                   cwd=REPO, check=True, capture_output=True)
    one = tidejax.load(model, engine=GLM_PAIR).generate(GLM_PROMPTS, max_new_tokens=30)
    profile = _pair_profile(tmp_path / "glm.toml", model, engine={**GLM_PAIR, "kv_pool_tokens": 64})
    with _serving_pair(profile) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=300)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            texts = list(pool.map(lambda prompt: client.completions.create(
                model="tiny", prompt=prompt, max_tokens=30, temperature=0).choices[0].text,
                GLM_PROMPTS))
    log = server_log(profile)
    assert re.search(r"request \d+ preempted", log) and re.search(r"request \d+ resumed", log)
    assert texts == one


def _refused(profile, *peer_sets: str) -> tuple[str, str]:
    """Both processes' error output where the boot guard refuses the pair."""
    peer = subprocess.Popen(
        [sys.executable, "-m", "tidejax.server", "--profile", str(profile),
         "--set", "distributed.process_id=1", *[a for s in peer_sets for a in ("--set", s)]],
        cwd=REPO, stderr=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    leader = subprocess.run(
        [sys.executable, "-m", "tidejax.server", "--profile", str(profile), "--port",
         str(free_port())],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    _, peer_err = peer.communicate(timeout=120)
    assert leader.returncode == peer.returncode == 2, (leader.stderr[-2000:], peer_err[-2000:])
    return leader.stderr, peer_err


def test_the_disk_tier_over_two_processes_without_a_state_dir_is_refused_naming_it(tmp_path):
    """A host budget below the experts on a mesh over two processes, no residency.state_dir:
    each process reads its shards of the experts from a prepared copy of them, which has no
    folder (the disk tier over two processes: tests/distributed/test_disk_tier.py)."""
    profile = _pair_profile(tmp_path / "disk.toml",
                            residency={"budget_experts": 72, "host_budget_experts": 96})
    for err in _refused(profile):
        assert ("across 2 processes each reads its shards of the experts from a prepared copy "
                "of them; set residency.state_dir" in err)


LISTENING = """
import ipaddress, pathlib, sys
from tidejax import distributed
from tidejax.config import EngineConfig
config = EngineConfig.from_toml(sys.argv[1]).with_overrides(
    {"distributed": {"process_id": int(sys.argv[2])}})
channel = distributed.start(config)
port = int(config.distributed.coordinator.rsplit(":", 1)[1])
for table in ("tcp", "tcp6"):  # local address and state (0A: listening) of every socket
    for line in pathlib.Path("/proc/net", table).read_text().splitlines()[1:]:
        (host, at), state = line.split()[1].split(":"), line.split()[3]
        if state == "0A" and int(at, 16) == port:  # the address in 32-bit little-endian words
            raw = bytes.fromhex(host)
            ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
            print(getattr(ip, "ipv4_mapped", None) or ip)
channel.close()
"""


def test_the_coordinator_listens_on_the_address_given(tmp_path):
    """jax's coordinator service of process 0 listens on distributed.coordinator's host (here
    127.0.0.1), not on every interface."""
    profile = _pair_profile(tmp_path / "bind.toml")
    procs = [subprocess.Popen([sys.executable, "-c", LISTENING, str(profile), str(i)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"}) for i in (1, 0)]
    (_, peer_err), (out, err) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], (err[-2000:], peer_err[-2000:])
    assert out.splitlines() == ["127.0.0.1"], out


def test_the_boot_guard_names_the_setting_that_differs(tmp_path):
    leader, peer = _refused(_pair_profile(tmp_path / "guard.toml"), "residency.budget_experts=72")
    for err in (leader, peer):
        assert "process 1 differs from process 0 in residency.budget_experts" in err


def test_the_boot_guard_names_the_checkpoint_file_that_differs(tmp_path):
    other = tmp_path / "other"
    shutil.copytree(DEMO, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    leader, peer = _refused(_pair_profile(tmp_path / "ckpt.toml"), f"model.path={other}")
    for err in (leader, peer):
        assert "checkpoint file config.json" in err and "model.path" in err
        assert "model-00001-of-00002.safetensors" not in err  # the same tensors


def test_a_peer_without_process_0_fails_in_time(tmp_path):
    profile = _pair_profile(tmp_path / "alone.toml", timeout_s=2)
    out = subprocess.run([sys.executable, "-m", "tidejax.server", "--profile", str(profile),
                          "--set", "distributed.process_id=1"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2
    assert "process 0 did not come up" in out.stderr and "distributed.timeout_s = 2" in out.stderr


def test_the_distributed_table_is_checked_naming_the_key():
    config = EngineConfig()
    assert config.distributed.num_processes == 1 and config.distributed.tensor_parallel == 0
    with pytest.raises(ConfigError, match="'distributed.coordinator' = 'nohost' should be"):
        config.with_overrides(parse_set("distributed.coordinator=nohost"))
    with pytest.raises(ConfigError, match="'distributed.num_processes' = 0 should be at least 1"):
        config.with_overrides(parse_set("distributed.num_processes=0"))
    two = config.with_overrides({"distributed": {"num_processes": 2}})
    with pytest.raises(ConfigError, match="'distributed.coordinator' .* is needed"):
        distributed.check(two)
    with pytest.raises(ConfigError, match="'distributed.process_id' = 2 should be below"):
        distributed.check(two.with_overrides({"distributed": {"process_id": 2,
                                                              "coordinator": "h:1"}}))
    env = {"TIDEJAX_COORDINATOR": "10.0.0.1:7000", "TIDEJAX_NUM_PROCESSES": "2",
           "TIDEJAX_PROCESS_ID": "1"}
    section = config.with_environment(env).distributed
    assert (section.coordinator, section.num_processes, section.process_id) == (
        "10.0.0.1:7000", 2, 1)
    with pytest.raises(ConfigError, match="TIDEJAX_PROCESS_ID.*'distributed.process_id' should be "
                                          "int, got 'one'"):
        config.with_environment({"TIDEJAX_PROCESS_ID": "one"})
    with pytest.raises(ConfigError, match="distributed.tensor_parallel = 2: only 1 devices"):
        tidejax.load(DEMO, engine=ENGINE, distributed={"tensor_parallel": 2})
