"""DeepSeek-V3 as an engine family."""

from __future__ import annotations

from tidejax.models.base import Family
from tidejax.models.deepseek_v3.config import DeepseekV3Config
from tidejax.models.deepseek_v3.model import build, build_mtp
from tidejax.models.deepseek_v3.weights import load_weights, mtp_specs
from tidejax.models.layers.decoder import expert_dims
from tidejax.models.layers.mla import MLACache
from tidejax.models.registry import register
from tidejax.text.toolcalls import DEEPSEEK_V3, KIMI_K2

register(Family(
    name="deepseek_v3",
    model_types=("deepseek_v3", "deepseek_v2", "kimi_k2"),
    config_from_hf=DeepseekV3Config.from_hf,
    build=build,
    build_mtp=build_mtp,
    mtp_specs=mtp_specs,
    load_weights=load_weights,
    expert_dims=expert_dims,
    top_k=lambda cfg: cfg.num_experts_per_tok,
    mla_decode=True,
    create_cache=MLACache.create,
    cache_axes=MLACache.axes,
    cache_bytes_per_token=MLACache.bytes_per_token,
    tool_formats={"deepseek_v3": DEEPSEEK_V3, "kimi_k2": KIMI_K2},
))
