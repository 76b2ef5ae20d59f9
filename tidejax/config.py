"""The serving profile as data: tables, choices, --set values.

`EngineConfig` is read from a serving profile (TOML) or from keyword overrides; it fails early,
naming the file and the field, when something that matters is missing or wrong. Model configs
(config.json) belong to their families: `tidejax/models/<family>/config.py`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from pathlib import Path
from typing import Any

from tidejax.errors import ConfigError
from tidejax.ops.dispatch import IMPLS, MHC_FRONT, MHC_FRONTS, MOE_PREFILL, MOE_PREFILL_KERNELS

# ---------------------------------------------------------------------------------------------
# Engine profiles


API_KEYS_ENV = "TIDEJAX_API_KEYS"  # the variable every profile reads keys from (comma-separated)


@dataclasses.dataclass(frozen=True)
class ModelSection:
    path: str = ""
    served_name: str = ""
    dtype: str = "float32"  # "bfloat16" | "float32": dense weights and activations
    experts: str = "checkpoint"  # "checkpoint" | "bf16" | "mxfp4": how routed experts are held
    # "float" | "fp8": dense projections stored FP8 kept so on the device (DeepSeek-V4.1 only)
    dense_format: str = "float"


@dataclasses.dataclass(frozen=True)
class EngineSection:
    max_context: int = 2048
    lanes: int = 4
    prefill_chunk: int = 256  # prompt tokens a step carries beside the decoding lanes
    page_size: int = 64  # tokens a KV page holds
    kv_pool_tokens: int = 0  # tokens the KV pool holds (all sequences together); 0: see kv_pool_gib
    kv_pool_gib: float = 0.0  # or its size in GiB; both 0: lanes x max_context tokens
    kernel: str = "auto"  # "auto" | "pallas" | "reference"
    # a prompt chunk's routed experts, where kernel picks the kernels: "pallas_dots" | "triton"
    moe_prefill: str = MOE_PREFILL
    # DeepSeek-V4 / V4.1: an mHC site's mixes and collapse on a GPU: "chain" | "fused"
    mhc_front: str = MHC_FRONT
    # DeepSeek-V4.1: its runs of like layers compiled once each and scanned (a third less
    # warm-up, a slower decode step today: docs/DESIGN.md, scan_layers); off: unrolled
    scan_layers: bool = False
    trace_dir: str = ""
    compile_cache: str = ""  # JAX's persistent compilation cache folder ("" = none)
    # threads that compile the warm-up's step shapes side by side; 0: one on a CPU backend (XLA's
    # CPU compiler already uses every core), else one a core up to the number of shapes
    compile_workers: int = 0
    warmup: bool = True  # a server compiles every step shape before it reports ready


@dataclasses.dataclass(frozen=True)
class ResidencySection:
    budget_experts: int = 0  # slots in the bank; 0 with budget_gib 0 means all experts resident
    budget_gib: float = 0.0
    # routed experts held in host memory; 0 = every expert (the host pool holds them all). Fewer:
    # the host pool is a cache of the experts on disk (residency/hostcache.py), above the bank
    host_budget_experts: int = 0
    host_budget_gib: float = 0.0  # the same budget in GiB of rows as served (not both)
    geometry: str = "per_layer"  # "per_layer" | "arena"
    miss_policy: str = "exact"  # "exact" | "substitute" | "ring" | "cpu" | "auto"
    ring_slots: int = 0
    # "auto" only: a miss carrying at least exact_weight of its token's routing weight is computed
    # on the host, at most exact_budget such picks a step (0: no cap), the rest substituted; the
    # threshold drops while a step's approximately served share of routing weight exceeds
    # max_approx_share (1: never)
    exact_weight: float = 0.2
    exact_budget: int = 0
    max_approx_share: float = 1.0
    drain_every: int = 64
    half_life: float = 500.0
    hysteresis: float = 1.5
    max_swaps_per_layer: int = 2
    max_swaps_per_step: int = 8
    adapt: bool = True
    count: bool = True
    seed_map: str = ""
    state_dir: str = ""
    # routing traces (residency/trace.py): every trace_every_steps-th step's picks recorded under
    # state_dir/routing (0: off), the chunks kept within trace_max_mib (the oldest removed first)
    trace_every_steps: int = 0
    trace_max_mib: float = 64.0


@dataclasses.dataclass(frozen=True)
class ServerSection:
    host: str = ""  # "" = 127.0.0.1, with or without API keys; set it to bind elsewhere
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    api_keys_env: str = API_KEYS_ENV  # "" = no keys from the environment
    max_body_bytes: int = 4 << 20
    max_tokens_limit: int = 4096
    # admission (server/admission.py): the server holds at most lanes + max_queued engine
    # requests (a request's `n` choices are n), at most max_requests_per_key of them for one API
    # key (0: no per-key limit); past either a request gets 429 with Retry-After
    max_queued: int = 64
    max_requests_per_key: int = 0
    request_timeout_s: float = 600.0  # from arrival to the last token; 0: no deadline
    body_timeout_s: float = 30.0  # to receive a request's body, once its headers are in
    dashboard: bool = True  # GET /dashboard (the residency dashboard) and its state.json


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """Several processes as one model (tidejax.distributed); each key also from the environment
    (DISTRIBUTED_ENV), which a --set overrides."""

    coordinator: str = ""  # "host:port" of process 0's coordination service ("" = one process)
    num_processes: int = 1
    process_id: int = 0
    tensor_parallel: int = 0  # the mesh's "tensor" axis: 0 = every device (of every process)
    timeout_s: int = 120  # how long a process waits for its peers at start
    heartbeat_s: int = 10  # a peer unheard of this long is gone (jax's heartbeat, the channel's pings)


@dataclasses.dataclass(frozen=True)
class CacheSection:
    """Prompt caching: full KV pages of earlier sequences shared by a prompt that starts with the
    same tokens (kv/pages.py)."""

    enabled: bool = True
    host_gib: float = 4.0  # pages evicted from the device kept in host memory (0 = none)
    disk_gib: float = 16.0  # pages leaving host memory written to disk (0 = none)
    disk_dir: str = ""  # their folder ("" = residency.state_dir; neither: no disk tier)


@dataclasses.dataclass(frozen=True)
class SpeculativeSection:
    """Speculative decoding: k tokens drafted a step and verified together (runtime/speculative.py)."""

    method: str = "none"  # "none" | "mtp": the checkpoint's own multi-token-prediction layer drafts
    tokens: int = 1  # k, the tokens drafted a step (a verify step runs k + 1 positions a lane)


# [distributed] key -> the environment variable it is also read from
DISTRIBUTED_ENV = {"coordinator": "TIDEJAX_COORDINATOR", "num_processes": "TIDEJAX_NUM_PROCESSES",
                   "process_id": "TIDEJAX_PROCESS_ID"}

MISS_POLICIES = ("exact", "substitute", "ring", "cpu", "auto")  # how a non-resident pick is served
AUTO_KEYS = ("exact_weight", "exact_budget", "max_approx_share")  # [residency] keys of "auto" alone

_CHOICES = {
    ("model", "dtype"): ("bfloat16", "float32"),
    ("model", "experts"): ("checkpoint", "bf16", "mxfp4"),
    ("model", "dense_format"): ("float", "fp8"),
    ("engine", "kernel"): IMPLS,
    ("engine", "moe_prefill"): MOE_PREFILL_KERNELS,
    ("engine", "mhc_front"): MHC_FRONTS,
    ("residency", "geometry"): ("per_layer", "arena"),
    ("residency", "miss_policy"): MISS_POLICIES,
    ("speculative", "method"): ("none", "mtp"),
}

# (table, key) -> (lowest, highest or None, lowest excluded); every float must also be finite
_RANGES = {
    ("engine", "max_context"): (1, None, False),
    ("engine", "lanes"): (1, None, False),
    ("engine", "prefill_chunk"): (1, None, False),
    ("engine", "page_size"): (1, None, False),
    ("engine", "kv_pool_tokens"): (0, None, False),
    ("engine", "kv_pool_gib"): (0, None, False),
    ("engine", "compile_workers"): (0, None, False),
    ("residency", "budget_experts"): (0, None, False),
    ("residency", "budget_gib"): (0, None, False),
    ("residency", "host_budget_experts"): (0, None, False),
    ("residency", "host_budget_gib"): (0, None, False),
    ("residency", "ring_slots"): (0, None, False),
    ("residency", "drain_every"): (1, None, False),
    ("residency", "half_life"): (0, None, True),
    ("residency", "hysteresis"): (1, None, False),
    ("residency", "max_swaps_per_layer"): (0, None, False),
    ("residency", "max_swaps_per_step"): (0, None, False),
    ("residency", "exact_weight"): (0, None, False),
    ("residency", "exact_budget"): (0, None, False),
    ("residency", "max_approx_share"): (0, 1, False),
    ("residency", "trace_every_steps"): (0, None, False),
    ("residency", "trace_max_mib"): (0, None, True),
    ("server", "port"): (1, 65535, False),
    ("server", "max_body_bytes"): (1, None, False),
    ("server", "max_tokens_limit"): (1, None, False),
    ("server", "max_queued"): (0, None, False),
    ("server", "max_requests_per_key"): (0, None, False),
    ("server", "request_timeout_s"): (0, None, False),
    ("server", "body_timeout_s"): (0, None, True),
    ("cache", "host_gib"): (0, None, False),
    ("cache", "disk_gib"): (0, None, False),
    ("distributed", "num_processes"): (1, None, False),
    ("distributed", "process_id"): (0, None, False),
    ("distributed", "tensor_parallel"): (0, None, False),
    ("distributed", "timeout_s"): (1, None, False),
    ("distributed", "heartbeat_s"): (2, None, False),
    ("speculative", "tokens"): (1, 4, False),
}

# settings that must be a power of two (the page size: the paged decode kernel's, default.toml)
_POWERS_OF_TWO = (("engine", "page_size"),)

# settings that name a file or folder: in a profile, relative to the repository root (the
# profile's parent folder's parent, where configs/ lives); on the command line, to the working
# directory
PATHS = (("model", "path"), ("engine", "trace_dir"), ("engine", "compile_cache"),
          ("residency", "seed_map"), ("residency", "state_dir"), ("cache", "disk_dir"))

_SECTIONS = {
    "model": ModelSection,
    "engine": EngineSection,
    "residency": ResidencySection,
    "server": ServerSection,
    "distributed": DistributedSection,
    "cache": CacheSection,
    "speculative": SpeculativeSection,
}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """A serving profile: the tables of DESIGN.md's "Profiles", validated."""

    model: ModelSection = ModelSection()
    engine: EngineSection = EngineSection()
    residency: ResidencySection = ResidencySection()
    server: ServerSection = ServerSection()
    distributed: DistributedSection = DistributedSection()
    cache: CacheSection = CacheSection()
    speculative: SpeculativeSection = SpeculativeSection()
    source: str = "<defaults>"
    given: tuple[tuple[str, str], ...] = ()  # ("table.key", who gave its value), latest last

    def source_of(self, key: str) -> str:
        """Who gave `key` ("table.key") its value: a --set, a variable, else the profile."""
        return dict(self.given).get(key, self.source)

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
                _check(source, name, key, updates[key])
            sections[name] = dataclasses.replace(current, **updates)
        unknown = set(tables) - set(_SECTIONS)
        if unknown:
            raise ConfigError(f"{source}: unknown table [{sorted(unknown)[0]}] "
                              f"(known: {', '.join(_SECTIONS)})")
        _check_auto_keys(source, sections["residency"])
        _check_trace(source, sections["residency"])
        _check_distributed(source, sections["distributed"])
        given = base.given + tuple((f"{name}.{key}", source) for name in _SECTIONS
                                   for key in tables.get(name, {}))
        return EngineConfig(**sections, given=given,
                            source=source if base.source == "<defaults>" else base.source)

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
        root = path.resolve().parent.parent
        for table, key in PATHS:
            value = getattr(getattr(config, table), key)
            if value and not Path(value).is_absolute():
                section = dataclasses.replace(getattr(config, table),
                                              **{key: str((root / value).resolve())})
                config = dataclasses.replace(config, **{table: section})
        return config

    def with_environment(self, environ=os.environ) -> "EngineConfig":
        """The [distributed] keys set in the environment (DISTRIBUTED_ENV) on top of this
        profile, each value read as a --set value is."""
        given = {key: toml_value(environ[name]) for key, name in DISTRIBUTED_ENV.items()
                 if environ.get(name, "") != ""}
        if not given:
            return self
        names = ", ".join(DISTRIBUTED_ENV[key] for key in given)
        return self.with_overrides({"distributed": given}, source=f"{self.source} + {names}")

    def with_overrides(self, overrides: dict, source: str | None = None) -> "EngineConfig":
        """`overrides` on top of this profile; errors name `source` (default: the profile)."""
        return EngineConfig.from_dict(overrides, source=source or self.source, base=self)


def toml_value(text: str):
    """A --set value: a TOML value where it parses as one (8, true, ["a", "b"], "quoted"), else
    the text itself (exact, 127.0.0.1:1234, /models/x)."""
    try:
        parsed = tomllib.loads(f"value = {text}")
    except tomllib.TOMLDecodeError:
        return text
    return parsed["value"] if len(parsed) == 1 else text


def parse_set(item: str) -> dict:
    """"engine.lanes=8" -> {"engine": {"lanes": 8}}."""
    key, eq, value = item.partition("=")
    table, dot, name = key.strip().partition(".")
    if not eq or not dot or not table or not name:
        raise ConfigError(f"--set {item!r}: expected table.key=value")
    return {table: {name: toml_value(value.strip())}}


def _coerce(source: str, key: str, value: Any, default: Any) -> Any:
    """`value` as the type of `default`: TOML and Python values as they are (an int where a float
    is wanted is taken), never text parsed into a number."""
    kind = type(default)
    if kind is tuple:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{source}: '{key}' should be a list of strings, got {value!r}")
        return tuple(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{source}: '{key}' should be {kind.__name__}, got {value!r}")
    return value


def _check_auto_keys(source: str, section: ResidencySection) -> None:
    """The keys only miss_policy "auto" reads, set under another policy, fail: a key accepted and
    then ignored would hide a mistake."""
    if section.miss_policy == "auto":
        return
    defaults = ResidencySection()
    for key in AUTO_KEYS:
        value = getattr(section, key)
        if value != getattr(defaults, key):
            raise ConfigError(f"{source}: 'residency.{key}' = {value!r} is read by miss_policy "
                              f"'auto' only (miss_policy is {section.miss_policy!r})")


def _check_trace(source: str, section: ResidencySection) -> None:
    """Routing traces are written under state_dir (by process 0 alone across processes): on
    without a state_dir is refused."""
    every = section.trace_every_steps
    if every and not section.state_dir:
        raise ConfigError(f"{source}: 'residency.trace_every_steps' = {every} writes routing "
                          "traces under residency.state_dir, which is not set")


def _check_distributed(source: str, section: DistributedSection) -> None:
    """distributed.coordinator is "host:port" where given (what the keys say together is
    checked at start: tidejax.distributed.check)."""
    host, colon, port = section.coordinator.rpartition(":")
    if section.coordinator and not (colon and host and port.isdigit() and 0 < int(port) < 65535):
        raise ConfigError(f"{source}: 'distributed.coordinator' = {section.coordinator!r} should "
                          "be host:port (port below 65535: the channel takes the next one)")


def _check(source: str, table: str, key: str, value: Any) -> None:
    """The value's range or choices, naming `source` and the setting."""
    allowed = _CHOICES.get((table, key))
    if allowed and value not in allowed:
        raise ConfigError(f"{source}: '{table}.{key}' = {value!r} is not one of "
                          f"{', '.join(allowed)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: '{table}.{key}' = {value!r} should be a finite number")
    if (table, key) in _RANGES:
        low, high, low_open = _RANGES[(table, key)]
        if value < low or (low_open and value == low) or (high is not None and value > high):
            bound = f"above {low}" if low_open else f"at least {low}"
            bound += f" and at most {high}" if high is not None else ""
            raise ConfigError(f"{source}: '{table}.{key}' = {value!r} should be {bound}")
    if (table, key) in _POWERS_OF_TWO and value & (value - 1):
        raise ConfigError(f"{source}: '{table}.{key}' = {value!r} should be a power of two")
