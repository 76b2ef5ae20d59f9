"""Configuration as data.

`ModelConfig` is read from a checkpoint's config.json (one frozen dataclass per family, built by
`from_hf`); `EngineConfig` is read from a serving profile (TOML) or from keyword overrides. Both
fail early, naming the file and the field, when something that matters is missing or wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json or profile that cannot be used; the message names the file and the field."""


def read_json(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


class _Fields:
    """Typed access to a config dict that names the file and field on any error."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def req(self, name: str, kind: type = int) -> Any:
        if self.raw.get(name) is None:
            raise ConfigError(f"{self.source}: missing required field '{name}'")
        return self._cast(name, self.raw[name], kind)

    def opt(self, name: str, default: Any, kind: type = int) -> Any:
        value = self.raw.get(name)
        return default if value is None else self._cast(name, value, kind)

    def _cast(self, name: str, value: Any, kind: type) -> Any:
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise ConfigError(
                f"{self.source}: field '{name}' should be {kind.__name__}, got {value!r}")
        return value


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: the frequencies (`inv_freq` over `dim` rotary channels) and the scale
    applied to cos/sin (YaRN's attention factor), plus the extra softmax scale YaRN's
    mscale_all_dim asks of MLA."""

    theta: float
    dim: int
    kind: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    @staticmethod
    def from_hf(raw: dict, dim: int, max_position: int, source: str) -> "RopeConfig":
        """Reads `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (published)."""
        params = dict(raw.get("rope_parameters") or {})
        scaling = raw.get("rope_scaling") or {}
        if not params.get("rope_type") and scaling:
            params.update(scaling)
        theta = params.get("rope_theta", raw.get("rope_theta"))
        if theta is None:
            raise ConfigError(f"{source}: missing required field 'rope_theta'")
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in ("default", "yarn"):
            raise ConfigError(f"{source}: field 'rope_parameters.rope_type' = {kind!r} is not "
                              "supported (default, yarn)")
        if kind == "default":
            return RopeConfig(theta=float(theta), dim=dim)
        omax = params.get("original_max_position_embeddings")
        if omax is None:
            raise ConfigError(f"{source}: YaRN needs 'original_max_position_embeddings'")
        factor = params.get("factor") or max_position / omax
        return RopeConfig(
            theta=float(theta), dim=dim, kind="yarn", factor=float(factor),
            original_max_position=int(omax),
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 0), mscale_all_dim=float(params.get("mscale_all_dim") or 0),
            attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))

    @property
    def softmax_mscale(self) -> float:
        """MLA multiplies its softmax scale by mscale(factor, mscale_all_dim) squared (YaRN)."""
        if self.kind != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The DeepSeek-V3 family (DeepSeek-V2-Lite shape, V3, R1, V3.1, Kimi K2): MLA + DeepSeekMoE."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP of the first_k_dense_replace layers
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig
    rope_interleave: bool
    rms_norm_eps: float
    max_position_embeddings: int
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str  # "sigmoid" | "softmax"
    topk_method: str  # "noaux_tc" (bias for selection) | "greedy" | "group_limited_greedy"
    tie_word_embeddings: bool
    num_mtp_layers: int = 0
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    source: str = ""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the decoder layers whose MLP is a routed MoE."""
        return tuple(i for i in range(self.num_layers)
                     if i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0)

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.rope.softmax_mscale

    @staticmethod
    def from_hf(raw: dict, source: str = "config.json") -> "ModelConfig":
        f = _Fields(raw, source)
        heads = f.req("num_attention_heads")
        rope_dim = f.req("qk_rope_head_dim")
        max_pos = f.opt("max_position_embeddings", 4096)
        n_routed = f.req("n_routed_experts")
        n_group = f.opt("n_group", 1) or 1
        if n_routed % n_group:
            raise ConfigError(f"{source}: field 'n_group' = {n_group} does not divide "
                              f"n_routed_experts = {n_routed}")
        scoring = f.opt("scoring_func", "sigmoid", str)
        if scoring not in ("sigmoid", "softmax"):
            raise ConfigError(f"{source}: field 'scoring_func' = {scoring!r} is not supported")
        act = f.opt("hidden_act", "silu", str)
        if act != "silu":
            raise ConfigError(f"{source}: field 'hidden_act' = {act!r} is not supported (silu)")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            model_type=f.req("model_type", str),
            vocab_size=f.req("vocab_size"),
            hidden_size=f.req("hidden_size"),
            intermediate_size=f.req("intermediate_size"),
            num_layers=f.req("num_hidden_layers"),
            num_heads=heads,
            q_lora_rank=f.opt("q_lora_rank", None),
            kv_lora_rank=f.req("kv_lora_rank"),
            qk_nope_head_dim=f.req("qk_nope_head_dim"),
            qk_rope_head_dim=rope_dim,
            v_head_dim=f.req("v_head_dim"),
            rope=RopeConfig.from_hf(raw, rope_dim, max_pos, source),
            rope_interleave=f.opt("rope_interleave", True, bool),
            rms_norm_eps=f.opt("rms_norm_eps", 1e-6, float),
            max_position_embeddings=max_pos,
            n_routed_experts=n_routed,
            num_experts_per_tok=f.req("num_experts_per_tok"),
            moe_intermediate_size=f.req("moe_intermediate_size"),
            n_shared_experts=f.opt("n_shared_experts", 0),
            first_k_dense_replace=f.opt("first_k_dense_replace", 0),
            moe_layer_freq=f.opt("moe_layer_freq", 1),
            n_group=n_group,
            topk_group=f.opt("topk_group", 1) or 1,
            norm_topk_prob=f.opt("norm_topk_prob", True, bool),
            routed_scaling_factor=f.opt("routed_scaling_factor", 1.0, float),
            scoring_func=scoring,
            topk_method=f.opt("topk_method", "noaux_tc" if scoring == "sigmoid" else "greedy", str),
            tie_word_embeddings=f.opt("tie_word_embeddings", False, bool),
            num_mtp_layers=f.opt("num_nextn_predict_layers", f.opt("num_mtp_layers", 0)),
            hidden_act=act,
            eos_token_ids=eos_ids,
            source=source,
        )


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
    prefill_chunk: int = 256
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


_CHOICES = {
    ("model", "dtype"): ("bfloat16", "float32"),
    ("model", "experts"): ("checkpoint", "bf16", "mxfp4"),
    ("engine", "kernel"): ("auto", "pallas", "reference"),
    ("residency", "geometry"): ("per_layer", "arena"),
    ("residency", "miss_policy"): ("exact", "substitute", "ring"),
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
