"""The serving profile as data: tables, choices, --set values.

`EngineConfig` is read from a serving profile (TOML) or from keyword overrides; it fails early,
naming the file and the field, when something that matters is missing or wrong. Model configs
(config.json) belong to their families: `tidejax/models/<family>/config.py`.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

from tidejax.fields import ConfigError
from tidejax.pallas.dispatch import IMPLS

# ---------------------------------------------------------------------------------------------
# Engine profiles


@dataclasses.dataclass(frozen=True)
class ModelSection:
    path: str = ""
    served_name: str = ""
    dtype: str = "float32"  # "bfloat16" | "float32": dense weights and activations
    experts: str = "checkpoint"  # "checkpoint" | "bf16" | "mxfp4": how routed experts are held


@dataclasses.dataclass(frozen=True)
class EngineSection:
    max_context: int = 2048
    lanes: int = 4
    prefill_chunk: int = 256  # prompt tokens a step carries beside the decoding lanes
    page_size: int = 64  # tokens a KV page holds
    kv_pool_tokens: int = 0  # tokens the KV pool holds (all sequences together); 0: see kv_pool_gib
    kv_pool_gib: float = 0.0  # or its size in GiB; both 0: lanes x max_context tokens
    kernel: str = "auto"  # "auto" | "pallas" | "reference"
    trace_dir: str = ""


@dataclasses.dataclass(frozen=True)
class ResidencySection:
    budget_experts: int = 0  # slots in the bank; 0 with budget_gib 0 means all experts resident
    budget_gib: float = 0.0
    geometry: str = "per_layer"  # "per_layer" | "arena"
    miss_policy: str = "exact"  # "exact" | "substitute" | "ring"
    ring_slots: int = 0
    drain_every: int = 64
    half_life: float = 500.0
    hysteresis: float = 1.5
    max_swaps_per_layer: int = 2
    max_swaps_per_step: int = 8
    adapt: bool = True
    count: bool = True
    seed_map: str = ""
    state_dir: str = ""


@dataclasses.dataclass(frozen=True)
class ServerSection:
    host: str = ""  # "" = 127.0.0.1 without API keys; set explicitly to bind elsewhere
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    api_keys_env: str = ""
    max_body_bytes: int = 4 << 20
    max_tokens_limit: int = 4096


MISS_POLICIES = ("exact", "substitute", "ring")  # how a pick of a non-resident expert is served

_CHOICES = {
    ("model", "dtype"): ("bfloat16", "float32"),
    ("model", "experts"): ("checkpoint", "bf16", "mxfp4"),
    ("engine", "kernel"): IMPLS,
    ("residency", "geometry"): ("per_layer", "arena"),
    ("residency", "miss_policy"): MISS_POLICIES,
}

_SECTIONS = {
    "model": ModelSection,
    "engine": EngineSection,
    "residency": ResidencySection,
    "server": ServerSection,
}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """A serving profile: the tables of DESIGN.md's "Profiles", validated."""

    model: ModelSection = ModelSection()
    engine: EngineSection = EngineSection()
    residency: ResidencySection = ResidencySection()
    server: ServerSection = ServerSection()
    source: str = "<defaults>"

    @staticmethod
    def from_dict(tables: dict, source: str = "<overrides>", base: "EngineConfig | None" = None,
                  ) -> "EngineConfig":
        """Builds a profile from `{table: {key: value}}`, on top of `base`; unknown tables or keys
        and values of the wrong type fail naming `source` and `table.key`."""
        base = base or EngineConfig()
        sections = {}
        for name, cls in _SECTIONS.items():
            current = getattr(base, name)
            given = tables.get(name, {})
            if not isinstance(given, dict):
                raise ConfigError(f"{source}: [{name}] should be a table")
            fields = {fl.name: fl for fl in dataclasses.fields(cls)}
            updates = {}
            for key, value in given.items():
                if key not in fields:
                    raise ConfigError(f"{source}: unknown key '{name}.{key}' "
                                      f"(known: {', '.join(sorted(fields))})")
                updates[key] = _coerce(source, f"{name}.{key}", value, getattr(current, key))
                allowed = _CHOICES.get((name, key))
                if allowed and updates[key] not in allowed:
                    raise ConfigError(f"{source}: '{name}.{key}' = {value!r} is not one of "
                                      f"{', '.join(allowed)}")
            sections[name] = dataclasses.replace(current, **updates)
        unknown = set(tables) - set(_SECTIONS)
        if unknown:
            raise ConfigError(f"{source}: unknown table [{sorted(unknown)[0]}] "
                              f"(known: {', '.join(_SECTIONS)})")
        return EngineConfig(**sections, source=source if base.source == "<defaults>" else base.source)

    @staticmethod
    def from_toml(path: str | os.PathLike) -> "EngineConfig":
        path = Path(path)
        try:
            tables = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: profile not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
        config = EngineConfig.from_dict(tables, source=str(path))
        if config.model.path and not Path(config.model.path).is_absolute():
            # model paths in a profile are relative to the repository root (the profile's parent dir)
            resolved = (path.parent.parent / config.model.path).resolve()
            config = dataclasses.replace(
                config, model=dataclasses.replace(config.model, path=str(resolved)))
        return config

    def with_overrides(self, overrides: dict) -> "EngineConfig":
        return EngineConfig.from_dict(overrides, source=self.source, base=self)


def _coerce(source: str, key: str, value: Any, default: Any) -> Any:
    kind = type(default)
    if kind is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{source}: '{key}' should be a list of strings, got {value!r}")
        return tuple(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if kind in (int, float) and isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            pass
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{source}: '{key}' should be {kind.__name__}, got {value!r}")
    return value
