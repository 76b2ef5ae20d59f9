"""A warm restart from the step executables kept under engine.compile_cache
(runtime/executables.py): a synthetic DeepSeek-V4.1 (two layers) started twice on one folder,
the second start's warm-up tracing no step (DonatingStep.traces) and answering as the first,
its state donated into the loaded executables, as does a copy of the state folder and the
checkpoint at other paths; a changed setting keys new executables; a corrupted file is compiled
again with one log line, and the engine still serves, its executables loaded one by one or side by
side alike; a folder that cannot be written is logged and the engine serves. Two step shapes (one page, one prompt bucket): their compiles are the test's time."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import jax
import pytest

import tidejax
from tidejax.runtime.executables import MAGIC
from tidejax.runtime.steps import DonatingStep

ENGINE = {"lanes": 1, "max_context": 64, "prefill_chunk": 16, "page_size": 64}
PROMPT = "The tide"


def start(model: Path, folder: Path, **engine):
    """A fresh engine on the state folder `folder` (its compile cache, and residency.state_dir
    in it), warmed up: (engine, its step's traces after warm-up)."""
    engine = tidejax.load(str(model), engine={**ENGINE, **engine, "compile_cache": str(folder)},
                          residency={"state_dir": str(folder / "state")})
    engine.warmup()
    return engine, engine.loaded.steps.step.traces


def answer(engine) -> str:
    return engine.generate(PROMPT, max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def cold(v41, tmp_path_factory):
    """The first start's folder and answer (every step shape lowered, compiled and saved)."""
    folder = tmp_path_factory.mktemp("xla")
    engine, traces = start(v41, folder)
    try:
        assert traces == len(engine.loaded.warmup_shapes()) == 2
        return folder, answer(engine)
    finally:
        engine.close()


def test_warm_restart_traces_no_step_and_answers_alike(v41, cold):
    folder, first = cold
    assert len(list((folder / "steps").glob("step-*.exe"))) == 2
    engine, traces = start(v41, folder)
    try:
        assert traces == 0
        assert engine.loaded.executables.loaded == 2
        # the state goes into the loaded executable donated, as into the jitted step
        runner = engine.runner
        donated = jax.tree.leaves(runner.state.replace(
            experts=runner.state.experts.without_rows()))
        assert answer(engine) == first
        assert all(leaf.is_deleted() for leaf in donated)
        assert engine.loaded.steps.step.traces == 0
    finally:
        engine.close()


def test_a_moved_state_folder_and_checkpoint_load_their_executables(v41, cold, tmp_path):
    """The state folder and the checkpoint copied to new paths: the copy starts from the kept
    executables (no file-system location is part of their key)."""
    folder, first = cold
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    model = shutil.copytree(v41, tmp_path / "model")
    engine, traces = start(model, moved)
    try:
        assert traces == 0 and engine.loaded.executables.loaded == 2
        assert answer(engine) == first
    finally:
        engine.close()


def test_loads_side_by_side_keep_and_count_as_one_by_one(v41, cold, caplog):
    """engine.compile_workers 2: the kept executables are loaded on two threads, and each step
    keeps the same shapes' executables, counted, as when loaded on one."""
    folder, first = cold
    kept = {}
    for workers in (1, 2):
        caplog.clear()
        with caplog.at_level(logging.INFO, "tidejax.warmup"):
            engine, traces = start(v41, folder, compile_workers=workers)
        try:
            assert (f"2 of 2 step executables loaded from {folder / 'steps'} on {workers} "
                    "threads") in caplog.text
            assert traces == 0 and engine.loaded.executables.loaded == 2
            kept[workers] = set(engine.loaded.steps.step.kept)
            assert answer(engine) == first
        finally:
            engine.close()
    assert len(kept[2]) == 2 and kept[2] == kept[1]


@pytest.mark.parametrize("setting", [{"max_context": 128}, {"lanes": 2}])
def test_a_changed_setting_keys_new_executables(v41, cold, setting, caplog):
    folder, _ = cold
    engine = tidejax.load(str(v41), engine={**ENGINE, **setting, "compile_cache": str(folder)})
    try:
        shape = (0, None, 1)  # the decode step alone, a shape both profiles warm up
        assert shape in engine.loaded.warmup_shapes()
        inputs = engine.loaded.warmup_inputs(*shape, engine.residency.idle_batch())
        step = engine.loaded.steps.step
        executables = engine.loaded.executables
        shared = DonatingStep.shared(engine.loaded.step_params, engine.runner.state)
        [key] = executables.keys(shared, [(step, str(shape), inputs)])
        with caplog.at_level(logging.INFO, "tidejax.warmup"):
            assert executables.load([(step, str(shape), key, inputs)], 1) == [False]
        assert "none stored under its key" in caplog.text
        kept = {path.name for path in (folder / "steps").glob("*.exe")}
        assert executables.path(step, key).name not in kept
    finally:
        engine.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_corrupt_executable_is_compiled_again_and_serves(v41, cold, workers, caplog):
    """One truncated file of the two, loaded one by one or side by side: that one alone is
    compiled, with one log line naming it."""
    folder, first = cold
    path, other = sorted((folder / "steps").glob("step-*.exe"))
    data = path.read_bytes()
    assert data.startswith(MAGIC)
    path.write_bytes(data[:len(data) // 2])  # truncated
    with caplog.at_level(logging.INFO, "tidejax.warmup"):
        engine, traces = start(v41, folder, compile_workers=workers)
    try:
        assert caplog.text.count("corrupt or truncated") == 1 and path.name in caplog.text
        assert other.name not in caplog.text
        assert traces == 1 and engine.loaded.executables.loaded == 1
        assert answer(engine) == first
        assert path.read_bytes() != data[:len(data) // 2]  # saved whole again
    finally:
        engine.close()


def test_executables_that_cannot_be_saved_leave_the_engine_serving(v41, cold, tmp_path, caplog):
    _, first = cold
    (tmp_path / "steps").write_text("a file where the folder would go")
    with caplog.at_level(logging.INFO, "tidejax.warmup"):
        engine, traces = start(v41, tmp_path)
    try:
        assert traces == 2 and caplog.text.count("not saved (FileExistsError") == 2
        assert answer(engine) == first
    finally:
        engine.close()
