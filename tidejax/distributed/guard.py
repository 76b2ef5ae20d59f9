"""The boot guard: processes that would compute different numbers refuse to pair.

Each process describes what its numbers depend on as {field: digest}: every profile setting but
those that differ by design (distributed.process_id and .coordinator, server.host and .port)
or that process 0 alone reads (engine.warmup), the checkpoint's manifest a file at a time
(tensor names, dtypes, shapes and sizes from the safetensors headers; the other files,
config.json and the tokenizer's, by content), and the tidejax and jax versions. Process 0
compares every peer's with its own and names each field that differs, so the error says which
setting or file to fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import jax

import tidejax
from tidejax.checkpoint.safetensors_io import SafetensorsFile
from tidejax.config import EngineConfig

# settings that differ between processes by design, or that only process 0 reads (engine.warmup:
# the peers run process 0's warm-up plans): not compared
PER_PROCESS = {("distributed", "process_id"), ("distributed", "coordinator"),
               ("server", "host"), ("server", "port"), ("engine", "warmup")}


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(config: EngineConfig) -> dict[str, str]:
    """{field: digest} of everything that changes this process's numbers (see above)."""
    fields = {"tidejax version": tidejax.__version__, "jax version": jax.__version__}
    for table in dataclasses.fields(config):
        section = getattr(config, table.name)
        if not dataclasses.is_dataclass(section):
            continue
        for key, value in dataclasses.asdict(section).items():
            if (table.name, key) not in PER_PROCESS:
                fields[f"{table.name}.{key}"] = value
    model_dir = Path(config.model.path)
    for path in sorted(model_dir.iterdir()) if model_dir.is_dir() else []:
        if path.suffix == ".safetensors":
            fields[f"checkpoint file {path.name}"] = [
                (t.name, str(t.dtype), t.shape, t.nbytes)
                for t in SafetensorsFile(path).tensors.values()]
        elif path.is_file():
            fields[f"checkpoint file {path.name}"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return {field: _digest(value) for field, value in fields.items()}


def differences(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The fields whose digests differ, or that one side has and the other lacks."""
    return sorted(f for f in ours.keys() | theirs.keys() if ours.get(f) != theirs.get(f))
