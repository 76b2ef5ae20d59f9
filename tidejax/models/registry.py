"""config.json `model_type` -> the model family that implements it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tidejax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Family:
    """What the engine needs from a model family; every callable takes the family's config.

    build(cfg, serve_options, dtype) -> a flax module whose __call__ is
        (tokens, positions, token_mask, cache, experts) -> (logits [b, t, vocab], cache, experts)
    checkpoint_table(cfg) -> {hf tensor name: params path} (everything but routed experts)
    expert_prefixes(cfg) -> checkpoint prefix of each MoE layer's routed experts, rowmap order
    expert_dims(cfg) -> (moe layers, experts per layer, hidden, expert intermediate)
    param_shapes(cfg, serve_options, dtype) -> the params pytree as ShapeDtypeStructs
    create_cache(cfg, batch, length, dtype) -> the generation cache pytree (batch axis 0)
    """

    name: str
    model_types: tuple[str, ...]
    config_from_hf: Callable[[dict, str], Any]
    build: Callable
    param_shapes: Callable
    checkpoint_table: Callable
    expert_prefixes: Callable
    ignored_tensors: Callable
    expert_dims: Callable
    top_k: Callable  # (cfg) -> routed experts picked per token
    create_cache: Callable
    cache_bytes_per_token: Callable
    replay_variables: Callable  # (cfg, ids [b, t, L_moe, k]) -> the "replay" collection of the MoE layers
    swiglu_limit: Callable = lambda cfg: 0.0
    tool_format: str = "json"  # the server's tool-call parser for this family's chat format


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    for model_type in family.model_types:
        _FAMILIES[model_type] = family
    return family


def family_for(raw_config: dict, source: str) -> Family:
    _import_families()
    model_type = raw_config.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: missing required field 'model_type'")
    if model_type not in _FAMILIES:
        raise ConfigError(f"{source}: field 'model_type' = {model_type!r} is not supported "
                          f"(supported: {', '.join(sorted(_FAMILIES))})")
    return _FAMILIES[model_type]


def _import_families() -> None:
    from tidejax.models import deepseek_v3  # noqa: F401  (registers itself)
