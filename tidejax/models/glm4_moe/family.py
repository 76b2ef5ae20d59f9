"""GLM-4.5 as an engine family."""

from __future__ import annotations

from tidejax.models.base import Family
from tidejax.models.glm4_moe.config import Glm4MoeConfig
from tidejax.models.glm4_moe.model import build, build_mtp
from tidejax.models.glm4_moe.weights import load_weights, mtp_specs
from tidejax.models.layers.gqa import GQA_FAMILY
from tidejax.models.registry import register
from tidejax.text.toolcalls import GLM

register(Family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    config_from_hf=Glm4MoeConfig.from_hf,
    build=build,
    build_mtp=build_mtp,
    mtp_specs=mtp_specs,
    load_weights=load_weights,
    **GQA_FAMILY,
    tool_formats={"glm4_moe": GLM},
))
