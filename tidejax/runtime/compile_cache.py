"""A loaded model's own persistent compilation cache (engine.compile_cache).

JAX keeps one persistent compilation cache per process: `jax_compilation_cache_dir` names its
folder, and JAX opens it at the first compile after it is set and keeps it until
`reset_cache()` (jax 0.10 and 0.11 alike; there is no cache per jit or per context). So a
model's cache is JAX's, pointed at the model's folder only around the model's own work:
`compile_cache(folder)` sets the folder (every compile kept, the small ones too) and after the
block puts back what the process had, resetting JAX's cache on both sides so that each side
opens its own folder. A lock keeps two models' blocks from overlapping. JAX reads its settings
once after each reset (at the next compile, which it reports as a monitoring event), so a block
resets it only where it has read them since: a step that compiles nothing (every step after the
warm-up) costs two settings' updates, no reset. What a block cannot keep apart: another thread's
compile while it runs lands in the model's folder too.

This cache skips only XLA's compile (its key is the lowered module's hash): the warm-up's steps
are also kept whole beside it (runtime/executables.py), so that a warm restart does not trace
them; the small jits residency and sampling compile beside them read this one.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

# the process's settings a block replaces: the folder, and no threshold (every compile is kept:
# 16 of the 23 executables of a start of the tiny 8-layer synthetic on CPU compile in under
# half a second, and read back they cost less)
_KEYS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
         "jax_persistent_cache_min_entry_size_bytes")
_lock = threading.RLock()  # one block at a time: they all change the one cache of the process


def _settings() -> tuple:
    return tuple(getattr(jax.config, key) for key in _KEYS)


# JAX's events at the first compile after a reset, once it has read the settings
_READ = ("/jax/compilation_cache/tasks_using_cache", "/jax/compilation_cache/task_disabled_cache")
_read_since_reset = True  # unknown before the first block: the process may have compiled


def _on_event(event: str, **_) -> None:
    global _read_since_reset
    if event in _READ:
        _read_since_reset = True


jax.monitoring.register_event_listener(_on_event)


def _apply(values: tuple) -> None:
    """The settings `values`, with JAX's cache reset where it has read the old ones (so that it
    opens the folder named here at its next compile)."""
    global _read_since_reset
    if _read_since_reset:
        jax_cache.reset_cache()
        _read_since_reset = False
    for key, value in zip(_KEYS, values):
        jax.config.update(key, value)


@contextlib.contextmanager
def compile_cache(folder: str):
    """Inside the block, JAX's compiles are kept in and read from `folder` ("" : the process's
    own setting, untouched); the process's settings before it after."""
    if not folder:
        yield
        return
    mine = (str(folder), 0.0, 0)
    with _lock:
        before = _settings()
        if before == mine:  # a block inside another of the same folder
            yield
            return
        Path(folder).mkdir(parents=True, exist_ok=True)
        _apply(mine)
        try:
            yield
        finally:
            _apply(before)
