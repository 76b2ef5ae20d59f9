"""Profiles and the command line: --set values as TOML values, one key source for every profile,
loopback unless --host, every bad setting a one-line error naming the setting and whoever gave
it (profile file or command-line argument), profile paths relative to the profile, --help."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.server_fixtures import free_port
from tidejax import __main__ as generate_cli
from tidejax.config import API_KEYS_ENV, EngineConfig, parse_set
from tidejax.errors import ConfigError
from tidejax.residency import __main__ as residency_cli
from tidejax.residency.history import History
from tidejax.server import __main__ as server_cli
from tidejax.server.app import api_keys

REPO = Path(__file__).resolve().parents[1]
PROFILES = sorted((REPO / "configs").glob("*.toml"))


@pytest.mark.parametrize("text,value", [
    ('["a","b"]', ["a", "b"]), ("[]", []), ("8", 8), ("0.5", 0.5), ("true", True),
    ('"quoted"', "quoted"), ("exact", "exact"), ("127.0.0.1:1234", "127.0.0.1:1234"),
    ("/models/x y", "/models/x y"), ("a = 1", "a = 1"),
])
def test_set_values_are_toml_where_they_parse(text, value):
    got = parse_set(f"table.key={text}")["table"]["key"]
    assert got == value and type(got) is type(value)


def config_of(*argv: str) -> EngineConfig:
    return server_cli.load_config(server_cli.build_parser().parse_args(["--profile", "tiny", *argv]))


def test_api_keys_from_set_and_from_the_variable_in_every_profile(monkeypatch):
    assert config_of("--set", 'server.api_keys=["a","b"]').server.api_keys == ("a", "b")
    assert config_of("--set", "server.api_keys=[]").server.api_keys == ()
    with pytest.raises(ConfigError, match=r"^--set server.api_keys=a: 'server.api_keys' should "
                                          "be a list of strings"):
        config_of("--set", "server.api_keys=a")
    monkeypatch.setenv(API_KEYS_ENV, "secret, other")
    for path in PROFILES:
        config = EngineConfig.from_toml(path)
        assert api_keys(config) == ("secret", "other"), path.name
        assert server_cli.bind_host(config) == "127.0.0.1", path.name  # keys never widen it
        assert "API keys on (2" in server_cli.keys_line(config)
    monkeypatch.delenv(API_KEYS_ENV)
    assert "API keys off" in server_cli.keys_line(EngineConfig.from_toml(PROFILES[0]))
    assert server_cli.bind_host(config_of("--host", "10.0.0.2")) == "10.0.0.2"


@pytest.mark.parametrize("argv,message", [
    (["--set", "engine.lanes=0"], "--set engine.lanes=0: 'engine.lanes' = 0 should be at least 1"),
    (["--set", "engine.max_context=0"], "'engine.max_context' = 0 should be at least 1"),
    (["--port", "99999"], "--port 99999: 'server.port' = 99999 should be at least 1 and at most "
                          "65535"),
    (["--set", "residency.budget_experts=-1"], "'residency.budget_experts' = -1 should be at "
                                               "least 0"),
    (["--set", "residency.budget_gib=-0.5"], "'residency.budget_gib' = -0.5"),
    (["--set", "cache.host_gib=-1"], "'cache.host_gib' = -1.0 should be at least 0"),
    (["--set", "cache.disk_gib=inf"], "'cache.disk_gib' = inf should be a finite number"),
    (["--set", "residency.half_life=nan"], "--set residency.half_life=nan: "
                                           "'residency.half_life' = nan should be a finite number"),
    (["--set", "residency.half_life=0"], "'residency.half_life' = 0.0 should be above 0"),
    (["--set", "residency.miss_policy=guess"], "'residency.miss_policy' = 'guess' is not one of"),
    (["--set", "engine.lanes=many"], "--set engine.lanes=many: 'engine.lanes' should be int"),
    (["--set", "engine.lanes=8", "--set", "engine.lanez=2"], "--set engine.lanez=2: unknown key"),
    (["--set", "lanes=8"], "--set 'lanes=8': expected table.key=value"),
    (["--profile", "no_such_profile"], "profile 'no_such_profile' not found"),
    (["--set", "distributed.process_id=1"], "--set distributed.process_id=1: "
                                            "'distributed.process_id' = 1 should be below"),
    (["--set", "distributed.num_processes=2"], "--set distributed.num_processes=2: "
                                               "'distributed.coordinator' (host:port"),
    (["--set", "engine.page_size=48"], "'engine.page_size' = 48 should be a power of two"),
    (["--profile", "/no/such/model"], "/no/such/model: no such checkpoint directory or profile"),
    (["--set", "server.body_timeout_s=0"], "'server.body_timeout_s' = 0.0 should be above 0"),
    (["--set", "server.max_queued=-1"], "'server.max_queued' = -1 should be at least 0"),
    (["--set", "server.request_timeout_s=inf"], "'server.request_timeout_s' = inf should be a "
                                                "finite number"),
    # a per-key limit without keys would be accepted and ignored
    (["--set", "server.api_keys_env=", "--set", "server.max_requests_per_key=2"],
     "--set server.max_requests_per_key=2: 'server.max_requests_per_key' = 2 limits each API "
     "key, and no key is set (server.api_keys)"),
])
def test_bad_settings_are_one_line_naming_the_setting(argv, message, capsys):
    assert server_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_profile_errors_blame_the_file(tmp_path, capsys):
    profile = tmp_path / "p.toml"
    profile.write_text("[residency]\nhalf_life = nan\n")
    assert server_cli.main(["--profile", str(profile)]) == 2
    assert f"error: {profile}: 'residency.half_life' = nan should be a finite number" in \
        capsys.readouterr().err


def test_profile_paths_are_relative_to_the_profile(tmp_path):
    (tmp_path / "configs").mkdir()
    profile = tmp_path / "configs" / "p.toml"
    profile.write_text('[model]\npath = "models/m"\n[engine]\ntrace_dir = "traces"\n'
                       '[residency]\nseed_map = "maps/seed.json"\nstate_dir = "state/p"\n')
    config = EngineConfig.from_toml(profile)
    root = tmp_path.resolve()
    assert (config.model.path, config.engine.trace_dir) == (str(root / "models/m"),
                                                            str(root / "traces"))
    assert config.residency.seed_map == str(root / "maps/seed.json")
    assert config.residency.state_dir == str(root / "state/p")
    # on the command line a path is the user's, read from the working directory
    assert config.with_overrides({"residency": {"state_dir": "here"}}).residency.state_dir == "here"


def test_truncated_checkpoint_is_one_line(tmp_path, capsys):
    model = tmp_path / "demo"
    shutil.copytree(REPO / "models" / "demo", model)
    shard = model / "model-00002-of-00002.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(100_000)
    port = free_port()
    assert server_cli.main(["--profile", "tiny", "--port", str(port),
                            "--set", f"model.path={model}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {shard}: truncated: tensor" in err, err
    assert generate_cli.main(["generate", "--model", str(model), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {shard}: truncated: tensor" in err, err
    assert generate_cli.main(["generate", "--model", str(tmp_path / "none"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "none" in err, err


def test_a_setting_checked_at_load_blames_who_gave_it(capsys):
    port = free_port()
    assert server_cli.main(["--profile", "tiny", "--port", str(port),
                            "--set", "engine.kv_pool_tokens=16"]) == 2
    err = capsys.readouterr().err  # the weights' progress bar, then the error
    assert "Traceback" not in err and err.splitlines()[-1].startswith(
        "error: --set engine.kv_pool_tokens=16: 'engine.kv_pool_tokens' gives a KV pool of"), err


def test_an_address_the_server_cannot_listen_on_is_one_line_naming_it(capsys):
    assert server_cli.main(["--profile", "tiny", "--host", "256.1.1.1", "--port", "8011"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: cannot listen on 256.1.1.1:8011 "
                                                    "(server.host or --host"), err


def test_help_lists_profiles_and_the_key_variable(capsys):
    with pytest.raises(SystemExit):
        server_cli.main(["--help"])
    out = capsys.readouterr().out
    for path in PROFILES:
        assert f"  {path.stem} " in out
    assert f"${API_KEYS_ENV}" in out and "127.0.0.1 unless --host" in out


def test_fit_into_a_missing_folder_is_one_line(tmp_path, capsys):
    history = History(2, 4)
    history.add([[3, 1, 0, 0], [0, 0, 2, 5]], [[1, 1, 0, 0], [0, 0, 1, 1]], 10)
    history.save(tmp_path / "history.npz")
    out = tmp_path / "missing" / "seed.json"
    assert residency_cli.main(["fit", "--history", str(tmp_path / "history.npz"),
                               "--budget", "4", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --out {out}: No such file or directory\n"
    assert residency_cli.main(["fit", "--history", str(tmp_path / "history.npz"),
                               "--budget", "4", "--out", str(tmp_path / "seed.json")]) == 0


def test_fit_on_a_foreign_file_names_it_and_gives_no_unpickling_advice(tmp_path, capsys):
    foreign = tmp_path / "objects.npy"
    np.save(foreign, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert residency_cli.main(["fit", "--history", str(foreign), "--budget", "4",
                               "--out", str(tmp_path / "seed.json")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {foreign}: not a demand history (pickled objects)\n", err


CACHED_RUN = """
import sys
import jax
import tidejax
hits = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None)
engine = tidejax.load("tiny", engine={"compile_cache": sys.argv[1]})
engine.generate("The tide", max_new_tokens=2)
print("hits", len(hits))
"""


def test_a_restart_reads_its_compiled_steps_from_the_compile_cache(tmp_path):
    """engine.compile_cache: the first process writes its compiled steps, the second reads them."""
    folder = tmp_path / "xla"

    def run():
        out = subprocess.run([sys.executable, "-c", CACHED_RUN, str(folder)], capture_output=True,
                             text=True, timeout=300, cwd=REPO)
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout.split("hits")[-1])

    assert run() == 0
    written = sorted(p.name for p in folder.iterdir())
    assert written  # the decode and prefill steps at least
    assert run() >= len(written)
    assert sorted(p.name for p in folder.iterdir()) == written  # nothing compiled anew


def test_an_engines_compile_cache_is_its_own(tmp_path):
    """engine.compile_cache belongs to the loaded model, not the process: the engine's compiles
    land in its folder; outside its calls the process's own setting holds (a plain jit writes
    the process's folder, not the engine's); a second engine with another folder writes that
    one alone; a third with the first folder reads it (cache hits, nothing compiled anew)."""
    import jax
    import jax.numpy as jnp

    import tidejax

    def entries(folder):
        return sorted(p.name for p in folder.iterdir()) if folder.exists() else []

    def run(folder):
        """(cache hits, cache misses) of loading the tiny profile and generating with it."""
        seen = []
        listener = lambda event, **_: seen.append(event)  # noqa: E731
        jax.monitoring.register_event_listener(listener)
        try:
            engine = tidejax.load("tiny", engine={"compile_cache": str(folder)})
            engine.generate("The tide", max_new_tokens=2)
        finally:
            jax.monitoring.unregister_event_listener(listener)
        assert jax.config.jax_compilation_cache_dir == str(process)  # the process's again
        return (seen.count("/jax/compilation_cache/cache_hits"),
                seen.count("/jax/compilation_cache/cache_misses"))

    process, first, second = tmp_path / "process", tmp_path / "first", tmp_path / "second"
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = [getattr(jax.config, key) for key in keys]
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_dir", str(process))
    try:
        hits, misses = run(first)
        written = entries(first)
        assert written and misses == len(written) and entries(process) == []
        jax.jit(lambda x: x * 3 - 2)(jnp.ones(5)).block_until_ready()
        assert entries(process) and entries(first) == written

        run(second)
        assert entries(second) and entries(first) == written

        hits, misses = run(first)
        assert hits > 0 and misses == 0 and entries(first) == written
    finally:
        for key, value in zip(keys, before):
            jax.config.update(key, value)
        from jax.experimental.compilation_cache import compilation_cache
        compilation_cache.reset_cache()
