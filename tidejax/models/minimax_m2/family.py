"""MiniMax-M2 as an engine family."""

from __future__ import annotations

from tidejax.models.base import Family
from tidejax.models.layers.gqa import GQA_FAMILY
from tidejax.models.minimax_m2.config import MiniMaxM2Config
from tidejax.models.minimax_m2.model import build
from tidejax.models.minimax_m2.weights import load_weights
from tidejax.models.registry import register
from tidejax.text.toolcalls import MINIMAX_M2

register(Family(
    name="minimax_m2",
    model_types=("minimax_m2",),
    config_from_hf=MiniMaxM2Config.from_hf,
    build=build,
    load_weights=load_weights,
    **GQA_FAMILY,
    tool_formats={"minimax_m2": MINIMAX_M2},
))
