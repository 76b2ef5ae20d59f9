"""DeepSeek-V4 as an engine family: routed experts into the residency pool and served by the
shared MoE layer (budgets and miss policies apply); the compressed layers' entries and CSA's
indexer keys in the shared KV pool, the window rings and the compressors' rings per lane."""

from __future__ import annotations

from tidejax.models.base import Family
from tidejax.models.deepseek_v4.config import V4Config
from tidejax.models.deepseek_v4.model import DeepseekV4, V4Lanes, V4Pages
from tidejax.models.deepseek_v4.weights import expert_dims, load_weights
from tidejax.models.registry import register

register(Family(
    name="deepseek_v4",
    model_types=("deepseek_v4",),
    config_from_hf=V4Config.from_hf,
    build=DeepseekV4,
    load_weights=load_weights,
    expert_dims=expert_dims,
    top_k=lambda cfg: cfg.num_experts_per_tok,
    create_cache=V4Pages.create,
    create_lane_cache=lambda cfg, lanes, max_context, dtype: V4Lanes.create(cfg, lanes, dtype),
    page_multiple=lambda cfg: cfg.page_multiple,
    cache_bytes_per_token=V4Pages.bytes_per_token,
    cache_axes=V4Pages.axes,
    index_keys=lambda pages: tuple(k for k in pages.index_keys if k is not None),
    swiglu_limit=lambda cfg: cfg.swiglu_limit,
))
