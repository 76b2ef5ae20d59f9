"""GLM-4.5 as an engine family."""

from __future__ import annotations

from tidejax.models.base import Family
from tidejax.models.glm4_moe.config import Glm4MoeConfig
from tidejax.models.glm4_moe.model import build
from tidejax.models.glm4_moe.weights import load_weights
from tidejax.models.layers.decoder import expert_dims
from tidejax.models.layers.gqa import GQAPages
from tidejax.models.registry import register
from tidejax.text.toolcalls import GLM

register(Family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    config_from_hf=Glm4MoeConfig.from_hf,
    build=build,
    load_weights=load_weights,
    expert_dims=expert_dims,
    top_k=lambda cfg: cfg.num_experts_per_tok,
    # attention through ops.gqa_attention (the paged GQA kernel or its reference, both reading up
    # to the rows' positions): its block tables are max_context wide (Family.table_widths)
    create_cache=GQAPages.create,
    cache_axes=GQAPages.axes,
    cache_bytes_per_token=GQAPages.bytes_per_token,
    tool_formats={"glm4_moe": GLM},
))
