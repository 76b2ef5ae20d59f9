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
        (tokens, positions, token_mask, cache, block_table, experts[, host_inputs], replay=None)
        -> (logits [b, t, vocab] float32, cache, experts), the cache a kv.paged.PagedCache and
        block_table [b, P] each row's pages in its pool; replay [b, t, L_moe, k]: recorded picks
        the MoE layers route by instead of their routers' choice (passed only when given)
    load_weights(cfg, model_dir, raw_config, serve_options, dtype, put_row) -> (params, aux):
        dense params on the device; routed experts through put_row(layer * E + expert, row);
        aux is whatever host-side state the family keeps (None for most)
    expert_dims(cfg) -> (moe layers, experts per layer, hidden, expert intermediate)
    create_cache(cfg, n_pages, page_size, dtype) -> the KV pool (PagedCache.pages): leaves
        [n_pages, rows, ...] shared by all sequences through one block table each
    create_lane_cache(cfg, lanes, max_context, dtype) -> the rows each decode lane keeps for a
        sequence of up to max_context (PagedCache.lanes, leaves [lanes, ...]: DeepSeek-V4.1's
        window rings, DeepSeek-V4's window and compressor rings), or None: none
    page_multiple(cfg) -> what engine.page_size must be a multiple of (DeepSeek-V4.1: its
        compress ratios, so that a page holds whole groups)
    mla_decode: decoding attends through pallas.paged_mla_decode over an MLA latent cache
        (cfg.kv_lora_rank, cfg.qk_rope_head_dim); the kernel's own choice for those shapes sets
        the decode tables' width. False: the family's decode reads whole block tables (jnp)
    cache_axes(pages) -> the logical axes of each pool leaf (a tuple per leaf, the pool's
        structure), or None: the pool is placed replicated (tidejax.parallel); the lane rows are
        always replicated
    host_inputs(cfg, aux, batch) -> an object whose rows(tokens [b, t], starts [b], mask [b, t],
        lanes) gives the step's host-computed inputs (DeepSeek-V4.1's Engram rows), and whose
        read_lane(lane) / write_lane(lane, saved) save and restore a lane's host state across a
        preemption; or None
    replays: whether build's forward takes `replay` (False: the family cannot replay recorded
        routing, and Engine.set_routing_replay refuses)
    """

    name: str
    model_types: tuple[str, ...]
    config_from_hf: Callable[[dict, str], Any]
    build: Callable
    load_weights: Callable
    expert_dims: Callable
    top_k: Callable  # (cfg) -> routed experts picked per token
    create_cache: Callable
    cache_bytes_per_token: Callable  # (cfg, dtype) -> pool bytes a token of context adds
    create_lane_cache: Callable = lambda cfg, lanes, max_context, dtype: None
    page_multiple: Callable = lambda cfg: 1
    mla_decode: bool = False
    replays: bool = True
    cache_axes: Callable | None = None
    host_inputs: Callable = lambda cfg, aux, batch: None
    swiglu_limit: Callable = lambda cfg: 0.0


# model_type -> the module that registers its family, imported on demand
FAMILY_MODULES = {
    "deepseek_v3": "tidejax.models.deepseek_v3.family",
    "deepseek_v2": "tidejax.models.deepseek_v3.family",
    "kimi_k2": "tidejax.models.deepseek_v3.family",
    "deepseek_v41": "tidejax.models.deepseek_v41.family",
    "deepseek_v4": "tidejax.models.deepseek_v4.family",
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
