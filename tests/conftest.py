"""Fixtures every test file may use: the seeded generator, and the tiny checkpoints several test
modules read, each written once a session (once a worker under `pytest -n 2`)."""

import gc
import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

# XLA's CPU backend at LLVM optimization level 0: compiling is most of the suite's time (2,163 s
# of backend compiles on two workers in a ~1,500 s run, 2026-12-06) and the tiny models' steps
# run in microseconds either way; O0 cut tests/models/test_deepseek_v41.py from 86 s to 67 s.
# XLA's CPU fusions by its older IR emitters, not the MLIR fusion emitters: half the compile
# time again (a tiny Mixtral's prefill step 21 s -> 10 s, decode 10.8 s -> 5.3 s, backend
# compiles of one served greedy run 34.7 s -> 17.1 s on a loaded 2-core machine, 2026-12-06),
# the same HLO, its fusions compiled by another code generator.
# No YNNPACK fusions (an empty --xla_cpu_experimental_ynn_fusion_type): jaxlib 0.10.2's
# `__ynn_fusion` crashes (SIGSEGV) or hangs on some x86-64 CPUs and not others (jax-ml/jax#39257,
# fixed in XNNPACK after that release). The tiny models' steps hold ~1,000 of them; a CI worker
# died of a segmentation fault on 2026-12-07 that two full runs here did not repeat, and this is
# the known crash of its kind in our jaxlib. Without them tests/models/test_deepseek_v41.py and
# tests/runtime/test_compiles.py took 209 s against 213 s.
# Set before anything starts XLA; the servers and tools the tests start inherit it. Only where
# no CUDA plugin is installed: on the GPU image (jaxlib 0.11.2) the kernels' tests exited 1
# printing nothing, twice, the likely cause a CPU flag that jaxlib no longer knows (XLA exits at
# its flags' parse, the message lost in pytest's capture); and the GPU compiles as served.
if not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
         "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_experimental_ynn_fusion_type="]).strip()


@pytest.hookimpl(trylast=True)  # after pytest's faulthandler plugin enables it on stderr
def pytest_configure(config):
    """A crashed worker's stacks reach the run's summary (tests/support/crash_report.py)."""
    from tests.support import crash_report
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        crash_report.enable_in_worker(worker)
    else:
        crash_report.prepare()


def pytest_terminal_summary(terminalreporter):
    from tests.support import crash_report
    crash_report.summarize(terminalreporter.write_line)


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """After each test file: every XLA:CPU executable its engines and jitted functions kept is
    released. Each one holds three memory mappings of LLVM's JIT code, and a process may hold
    vm.max_map_count of them (65,530 by default): past that, LLVM cannot allocate ("LLVM
    compilation error: Cannot allocate memory") and the process dies of a segmentation fault
    (reproduced at a limit of 4,000). A worker of `pytest -n 2` kept module-level jits' programs
    of every file it ran (jax's caches): up to 55,282 mappings by the run's end here, 2026-12-07
    (likely why two CI runs' workers died at 91% and 97%). With this release: at most 29,464 in
    a full run, which took 29:07 against 30:21; test_speculative_engine.py's 10,733 mappings
    went down to 1,287 after it."""
    yield
    if "jax" in sys.modules:
        import jax
        gc.collect()  # the engines of the file's fixtures, whose cycles hold their programs
        jax.clear_caches()


@pytest.fixture
def rng():
    """A generator from $TIDEJAX_TEST_SEED, or from the clock; the seed is printed (pytest shows
    it when the test fails), so a failure replays with TIDEJAX_TEST_SEED=<seed>."""
    seed = int(os.environ.get("TIDEJAX_TEST_SEED", time.time_ns() % 2**32))
    print(f"random seed {seed} (TIDEJAX_TEST_SEED={seed} replays it)")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`tiny_checkpoint(family, config, seed, **overrides)` -> the directory of a tiny random
    checkpoint of `family` in its named `config` (tests.support.tiny_models.FAMILIES), config
    fields replaced by `overrides` (num_hidden_layers=2, say), written by transformers
    the first time those arguments are asked for and shared after. Read only: a test that writes
    beside a checkpoint writes into its own tmp_path."""
    from tests.support.tiny_models import FAMILIES  # torch: imported by the tests that ask

    written = {}

    def get(family: str, config: str, seed: int = 0, **overrides) -> Path:
        key = (family, config, seed, tuple(sorted(overrides.items())))
        if key not in written:
            write, configs = FAMILIES[family]
            path = tmp_path_factory.mktemp(f"{family}-{config}-{seed}")
            write(path, seed=seed, **{**configs[config], **overrides})
            written[key] = path
        return written[key]

    return get


@pytest.fixture(scope="session")
def v3_mtp(tiny_checkpoint, tmp_path_factory) -> Path:
    """A tiny DeepSeek-V3 whose MTP layer drafts well (tiny_models.repeating_mtp)."""
    from tests.support.tiny_models import repeating_mtp

    base = tiny_checkpoint("deepseek_v3", "qlora_groups", seed=5)
    return repeating_mtp(base, tmp_path_factory.mktemp("v3-mtp") / "mtp", 0.3)


@pytest.fixture(scope="session")
def published(tmp_path_factory):
    """DeepSeek-V4.1's tiny_a in the published formats (published / "fp8") beside a float
    checkpoint of the values they stand for (published / "float"). Read only."""
    from tests.support.v41_published import write_published_pair

    return write_published_pair(tmp_path_factory.mktemp("v41"))
