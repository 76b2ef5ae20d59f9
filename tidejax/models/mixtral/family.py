"""Mixtral as an engine family."""

from __future__ import annotations

from tidejax.models.base import Family
from tidejax.models.layers.gqa import GQA_FAMILY
from tidejax.models.mixtral.config import MixtralConfig
from tidejax.models.mixtral.model import build
from tidejax.models.mixtral.weights import load_weights
from tidejax.models.registry import register
from tidejax.text.toolcalls import MISTRAL

register(Family(
    name="mixtral",
    model_types=("mixtral",),
    config_from_hf=MixtralConfig.from_hf,
    build=build,
    load_weights=load_weights,
    **GQA_FAMILY,
    tool_formats={"mixtral": MISTRAL},
))
