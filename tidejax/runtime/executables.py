"""Compiled step executables kept on disk, so that a warm restart neither traces nor lowers them.

JAX's persistent compilation cache (runtime/compile_cache.py) skips only XLA's compile: its key
is a hash of the lowered module, so a restart still traces and lowers every step shape (68 of a
40-layer DeepSeek-V4.1's 80 s warm restart on an H100, tracing holding the GIL). Here each
warm-up step's executable is serialized (jax.experimental.serialize_executable) into
`<engine.compile_cache>/steps/`, under a key of everything that decides the program: the step's
name and shape, its arguments' tree structure, avals and shardings (params, expert rows, the
donated state, inputs), the model's config and serve options (LoadedModel._executables: no file
or folder's location), the tidejax source (a hash of the package's .py files and built
extensions), jax and jaxlib versions, the backend, platform and devices, XLA_FLAGS and the jax
settings that change a lowering. What every step shares of it is digested once a warm-up
(StepExecutables.keys), and each step's key once. A restart with the same key loads the executable and the DonatingStep calls it in
place of its jitted function (DonatingStep.keep; the state is donated as before). No file for the key, a corrupt or
truncated one (its checksum), one stored for another key or one that fails to load: the step
is lowered and compiled as without, with one log line saying why, and saved again (one that
cannot be saved is logged, and the start goes on).

A file: MAGIC, then the sha256 of the payload, then the payload: a pickle of (key digest,
serialized executable, input tree, output tree). Written atomically (temp file, fsync, rename).
Not across processes: a peer's steps pair with process 0's through their collectives, and a
peer warms up through its jitted steps.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import logging
import os
import pickle
from pathlib import Path

import jax
import jaxlib
from jax.experimental import serialize_executable

from tidejax.residency.persist import write_atomic

log = logging.getLogger("tidejax.warmup")

MAGIC = b"tidejax-step-executable/1\n"

# jax settings that change what a step lowers or compiles to (read by name: where one version
# lacks a setting it reads as None in both keys)
_JAX_SETTINGS = (
    "jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
    "jax_threefry_partitionable", "jax_threefry_gpu_kernel_lowering", "jax_numpy_dtype_promotion",
    "jax_numpy_rank_promotion", "jax_use_shardy_partitioner", "jax_enable_checks",
    "jax_debug_nans", "jax_debug_infs", "jax_disable_jit", "jax_disable_most_optimizations",
    "jax_exec_time_optimization_effort", "jax_memory_fitting_effort", "jax_optimization_level",
    "jax_memory_fitting_level", "jax_compiler_enable_remat_pass", "jax_softmax_custom_jvp",
    "jax_high_dynamic_range_gumbel", "jax_pallas_use_mosaic_gpu",
    "jax_ragged_dot_use_ragged_dot_instruction", "jax_ragged_dot_use_gpu_pallas_triton_lowering",
    "jax_embedded_constants_max_bytes", "jax_use_simplified_jaxpr_constants")


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of the tidejax package's .py files and built extensions (.so: the CPU kernel, whose
    presence changes what a step lowers to and whose FFI target a step calls by name), their
    paths and bytes, read once a process."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted([*package.rglob("*.py"), *package.rglob("*.so")]):
        digest.update(str(path.relative_to(package)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def environment(device) -> dict:
    """The key's parts outside the model: source, versions, backend, devices (`device`: the
    first the model runs on), flags, settings."""
    return {"source": source_digest(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "backend": jax.default_backend(), "platform": device.client.platform_version,
            "devices": [jax.device_count(), device.device_kind],
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "settings": {name: repr(getattr(jax.config, name, None)) for name in _JAX_SETTINGS}}


def _arguments(tree) -> dict:
    """`tree`'s structure and each leaf's aval (shape, dtype, weak type) and where it is: a
    jax.Array's sharding, or 'host' for what the call places itself."""
    leaves, structure = jax.tree.flatten(tree)
    return {"tree": str(structure),
            "arguments": [f"{jax.typeof(leaf)} "
                          f"{repr(leaf.sharding) if isinstance(leaf, jax.Array) else 'host'}"
                          for leaf in leaves]}


def _digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class StepExecutables:
    """The step executables under `folder`/steps for one model, whose own key parts are
    `program` (LoadedModel._executables: its config and serve options, as text), run on
    `devices` (its mesh's, in the mesh's order)."""

    def __init__(self, folder: str | os.PathLike, program: dict, devices: list):
        self.folder = Path(folder) / "steps"
        self.program = program
        self.devices = devices
        self.loaded = 0  # executables loaded from disk (a warm restart's count)

    def keys(self, shared: tuple, steps: list[tuple]) -> list[str]:
        """sha256 of everything that decides the program of each of `steps` ((step, shape,
        inputs) each), called with `shared` before its inputs (DonatingStep.shared: the params,
        expert rows and state every step takes). What the steps share (the model's program, the
        environment, `shared`'s avals and shardings) is digested once for all of them."""
        common = _digest({"program": self.program, "environment": environment(self.devices[0]),
                          "devices": [device.id for device in self.devices],
                          **_arguments(shared)})
        return [_digest({"shared": common, "step": step.name, "shape": shape,
                         **_arguments(inputs)})
                for step, shape, inputs in steps]

    def path(self, step, key: str) -> Path:
        return self.folder / f"{step.name}-{key[:32]}.exe"

    def load(self, steps: list[tuple], workers: int) -> list[bool]:
        """Which of `steps` ((step, shape, key, inputs) each, `key` from `keys`) had their
        executables on disk and loaded, each kept by its step for calls with its inputs' shapes.
        The files are read and loaded side by side on `workers` threads (XLA's load runs mostly
        without the GIL); the keeping, the count and one log line for each that failed (to be
        compiled, as without) on the calling thread."""
        paths = [(self.path(step, key), key) for step, _, key, _ in steps]
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(self._try_read, paths))
        loaded = []
        for (step, shape, _, inputs), (path, _), result in zip(steps, paths, results):
            if isinstance(result, Exception):
                log.warning("step executable %s (%s %s): %s; lowering and compiling it",
                            path.name, step.name, shape, result)
                loaded.append(False)
            else:
                step.keep(inputs, result)
                self.loaded += 1
                loaded.append(True)
        return loaded

    def _try_read(self, where: tuple):
        """The executable at `where` (path, key), or the exception that its read raised: any
        failure to load means compiling it."""
        try:
            return self._read(*where)
        except Exception as error:
            return error

    def _read(self, path: Path, key: str):
        if not path.exists():
            raise LookupError("none stored under its key (a first start, or the model, its "
                              "options, the tidejax source, jax or the devices changed)")
        data = path.read_bytes()
        digest = data[len(MAGIC):len(MAGIC) + 32]
        payload = data[len(MAGIC) + 32:]
        if not data.startswith(MAGIC) or hashlib.sha256(payload).digest() != digest:
            raise ValueError("corrupt or truncated (its checksum does not match)")
        stored, serialized, in_tree, out_tree = pickle.loads(payload)
        if stored != key:
            raise ValueError("stored for another key")
        try:
            return serialize_executable.deserialize_and_load(
                serialized, in_tree, out_tree, execution_devices=self.devices)
        except Exception as error:
            raise RuntimeError(f"could not be loaded ({type(error).__name__}: {error})") from error

    def save(self, step, shape: str, key: str, inputs, compiled) -> None:
        """Writes `compiled` (`step` lowered and compiled for `inputs`, its `key` from `keys`)
        under its key, atomically, and has `step` keep it for calls with `inputs`'s shapes."""
        step.keep(inputs, compiled)
        path = self.path(step, key)
        try:
            serialized, in_tree, out_tree = serialize_executable.serialize(compiled)
            payload = pickle.dumps((key, serialized, in_tree, out_tree))
            write_atomic(path, MAGIC + hashlib.sha256(payload).digest() + payload)
        except Exception as error:  # the start goes on: the next one compiles it again
            log.warning("step executable %s (%s %s) not saved (%s: %s)", path.name, step.name,
                        shape, type(error).__name__, error)
