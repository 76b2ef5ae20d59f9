"""GLM-5 as an engine family."""

from __future__ import annotations

from tidejax.models.base import Family
from tidejax.models.glm_moe_dsa.config import GlmMoeDsaConfig
from tidejax.models.glm_moe_dsa.model import build, build_mtp
from tidejax.models.glm_moe_dsa.weights import load_weights, mtp_specs
from tidejax.models.layers.decoder import expert_dims
from tidejax.models.layers.dsa import DSAPages
from tidejax.models.registry import register
from tidejax.text.toolcalls import GLM

register(Family(
    name="glm_moe_dsa",
    model_types=("glm_moe_dsa",),
    config_from_hf=GlmMoeDsaConfig.from_hf,
    build=build,
    build_mtp=build_mtp,
    mtp_specs=mtp_specs,
    load_weights=load_weights,
    expert_dims=expert_dims,
    top_k=lambda cfg: cfg.num_experts_per_tok,
    # MLA decodes through the paged kernel while a table addresses at most index_topk entries,
    # past that over the indexer's picks (layers/dsa.py): both kernels' choices set the decode
    # tables' width (Family.table_widths)
    mla_decode=True,
    index_keys=lambda pages: tuple(k for k in pages.index_k if k is not None),
    create_cache=DSAPages.create,
    cache_axes=DSAPages.axes,
    cache_bytes_per_token=DSAPages.bytes_per_token,
    tool_formats={"glm_moe_dsa": GLM},
))
