"""config.json `model_type` -> the model family that implements it."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from tidejax.fields import ConfigError


@dataclasses.dataclass(frozen=True)
class Family:
    """What the engine needs from a model family; every callable takes the family's config.

    build(cfg, serve_options, dtype) -> a flax module whose __call__ is
        (tokens, positions, token_mask, cache, experts[, host_inputs], replay=None)
        -> (logits [b, t, vocab] float32, cache, experts); replay [b, t, L_moe, k]: recorded
        picks the MoE layers route by instead of their routers' choice
    load_weights(cfg, model_dir, raw_config, serve_options, dtype, put_row) -> (params, aux):
        dense params on the device; routed experts through put_row(layer * E + expert, row);
        aux is whatever host-side state the family keeps (None for most)
    expert_dims(cfg) -> (moe layers, experts per layer, hidden, expert intermediate)
    cache_kind: "paged" (one KV pool of pages shared by all sequences; build's module then takes
        a block table [b, P] after the cache) or "lanes" (a cache row per lane, [lanes, length, ...])
    create_cache(cfg, n_pages, page_size, dtype) for "paged", (cfg, batch, length, dtype) for
        "lanes" -> the generation cache pytree
    cache_axes(cache) -> the logical axes of each cache leaf (a tuple per leaf, the cache's
        structure), or None: the cache is placed replicated (tidejax.parallel)
    host_inputs(cfg, aux, batch) -> an object whose rows(tokens [b, t], starts [b], mask [b, t],
        lanes) gives the step's host-computed inputs (DeepSeek-V4.1's Engram rows), or None
    """

    name: str
    model_types: tuple[str, ...]
    config_from_hf: Callable[[dict, str], Any]
    build: Callable
    load_weights: Callable
    expert_dims: Callable
    top_k: Callable  # (cfg) -> routed experts picked per token
    cache_kind: str
    create_cache: Callable
    cache_bytes_per_token: Callable  # (cfg, dtype) -> bytes a token of context adds
    cache_axes: Callable | None = None
    host_inputs: Callable = lambda cfg, aux, batch: None
    swiglu_limit: Callable = lambda cfg: 0.0


# model_type -> the module that registers its family, imported on demand
FAMILY_MODULES = {
    "deepseek_v3": "tidejax.models.deepseek_v3.family",
    "deepseek_v2": "tidejax.models.deepseek_v3.family",
    "kimi_k2": "tidejax.models.deepseek_v3.family",
    "deepseek_v41": "tidejax.models.deepseek_v41.family",
}
_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    for model_type in family.model_types:
        _FAMILIES[model_type] = family
    return family


def family_for(raw_config: dict, source: str) -> Family:
    model_type = raw_config.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: missing required field 'model_type'")
    if model_type not in FAMILY_MODULES:
        raise ConfigError(f"{source}: field 'model_type' = {model_type!r} is not supported "
                          f"(supported: {', '.join(sorted(FAMILY_MODULES))})")
    importlib.import_module(FAMILY_MODULES[model_type])
    return _FAMILIES[model_type]
