"""Qwen3-MoE as an engine family."""

from __future__ import annotations

from tidejax.models.base import Family
from tidejax.models.layers.gqa import GQA_FAMILY
from tidejax.models.qwen3_moe.config import Qwen3MoeConfig
from tidejax.models.qwen3_moe.model import build
from tidejax.models.qwen3_moe.weights import load_weights
from tidejax.models.registry import register
from tidejax.text.toolcalls import HERMES

register(Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    config_from_hf=Qwen3MoeConfig.from_hf,
    build=build,
    load_weights=load_weights,
    **GQA_FAMILY,
    tool_formats={"qwen3_moe": HERMES},
))
