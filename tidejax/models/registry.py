"""config.json `model_type` -> the model family that implements it (the Family contract is in
tidejax.models.base)."""

from __future__ import annotations

import importlib

from tidejax.errors import ConfigError
from tidejax.models.base import Family


# model_type -> the module that registers its family, imported on demand
FAMILY_MODULES = {
    "deepseek_v3": "tidejax.models.deepseek_v3.family",
    "deepseek_v2": "tidejax.models.deepseek_v3.family",
    "kimi_k2": "tidejax.models.deepseek_v3.family",
    "deepseek_v41": "tidejax.models.deepseek_v41.family",
    "deepseek_v4": "tidejax.models.deepseek_v4.family",
    "glm4_moe": "tidejax.models.glm4_moe.family",
    "glm_moe_dsa": "tidejax.models.glm_moe_dsa.family",
    "qwen3_moe": "tidejax.models.qwen3_moe.family",
    "mixtral": "tidejax.models.mixtral.family",
    "minimax_m2": "tidejax.models.minimax_m2.family",
    "gpt_oss": "tidejax.models.gpt_oss.family",
}
_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    for model_type in family.model_types:
        _FAMILIES[model_type] = family
    return family


def family_for(raw_config: dict, source: str) -> Family:
    model_type = raw_config.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: missing required field 'model_type'")
    family = family_of(model_type)
    if family is None:
        raise ConfigError(f"{source}: field 'model_type' = {model_type!r} is not supported "
                          f"(supported: {', '.join(sorted(FAMILY_MODULES))})")
    return family


def family_of(model_type: str) -> Family | None:
    """The family serving `model_type` (its module imported on demand), or None."""
    if model_type not in FAMILY_MODULES:
        return None
    importlib.import_module(FAMILY_MODULES[model_type])
    return _FAMILIES[model_type]
