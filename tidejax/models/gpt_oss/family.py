"""gpt-oss as an engine family."""

from __future__ import annotations

from tidejax.models.base import Family
from tidejax.models.gpt_oss.config import GptOssConfig
from tidejax.models.gpt_oss.model import build
from tidejax.models.gpt_oss.weights import load_weights
from tidejax.models.layers.gqa import GQA_FAMILY
from tidejax.models.registry import register
from tidejax.text.harmony import HARMONY

register(Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    config_from_hf=GptOssConfig.from_hf,
    build=build,
    load_weights=load_weights,
    **GQA_FAMILY,
    swiglu_limit=lambda cfg: cfg.swiglu_limit,
    swiglu_form=lambda cfg: (cfg.swiglu_alpha, 1.0),  # g * sigmoid(alpha * g) * (up + 1)
    tool_formats={"gpt_oss": HARMONY},
))
