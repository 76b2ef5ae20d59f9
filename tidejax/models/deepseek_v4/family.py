"""DeepSeek-V4 as an engine family: routed experts into the residency pool and served by the
shared MoE layer (budgets and miss policies apply). Its whole cache is per lane (the
PagedCache's `lanes`): the window rings and per-layer compressed entries, sized for max_context;
its page pool holds nothing."""

from __future__ import annotations

from tidejax.models.base import Family
from tidejax.models.deepseek_v4.config import V4Config
from tidejax.models.deepseek_v4.model import DeepseekV4, V4Cache
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
    create_cache=lambda cfg, n_pages, page_size, dtype: (),
    cache_bytes_per_token=lambda cfg, dtype: 0,
    create_lane_cache=V4Cache.create,
    swiglu_limit=lambda cfg: cfg.swiglu_limit,
))
