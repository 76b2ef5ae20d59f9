"""Speculative decoding (issue 33): the [speculative] profile table and its start-up checks, and
the acceptance rules (runtime/speculative.py): greedy prefixes, and rejection sampling that keeps
the target distribution exactly."""

from __future__ import annotations

import pytest

from tidejax.config import EngineConfig
from tidejax.errors import ConfigError
from tidejax.runtime.build import LoadedModel
from tests.support.tiny_models import write_mtp_copy


def profile(path, **speculative) -> EngineConfig:
    return EngineConfig.from_dict({"model": {"path": str(path)}, "speculative": speculative},
                                  source="spec.toml")


def test_speculative_table_defaults_and_ranges():
    """Off by default; method is a choice, tokens 1..4, each failing naming the key."""
    assert EngineConfig().speculative.method == "none"
    assert EngineConfig().speculative.tokens == 1
    assert profile("x", method="mtp", tokens=4).speculative.tokens == 4
    with pytest.raises(ConfigError, match=r"spec.toml: 'speculative.method' = 'eagle' is not one"):
        profile("x", method="eagle")
    for k in (0, 5):
        with pytest.raises(ConfigError, match=rf"'speculative.tokens' = {k} should be"):
            profile("x", tokens=k)
    with pytest.raises(ConfigError, match=r"unknown key 'speculative.depth'"):
        profile("x", depth=2)


def test_mtp_refused_at_start_naming_what_is_missing(tiny_checkpoint, tmp_path):
    """method = "mtp" on a checkpoint without an MTP layer names config.json's field; on a family
    without an MTP draft forward names the family; on a checkpoint that has one, says the verify
    step is not run yet (refused, not accepted and ignored). "none" loads either."""
    plain = tiny_checkpoint("deepseek_v3", "qlora_groups")
    with pytest.raises(ConfigError, match=r"spec.toml: 'speculative.method' = 'mtp' but "
                                          r".*config.json has no MTP layer .*"
                                          r"'num_nextn_predict_layers'"):
        LoadedModel(profile(plain, method="mtp"))
    with pytest.raises(ConfigError, match=r"the mixtral family has no MTP draft forward"):
        LoadedModel(profile(tiny_checkpoint("mixtral", "top2"), method="mtp"))
    with_mtp = tmp_path / "mtp"
    write_mtp_copy(plain, with_mtp, attention_from=0, moe_from=1)
    with pytest.raises(ConfigError, match=r"verify step is not run by the engine yet"):
        LoadedModel(profile(with_mtp, method="mtp", tokens=3))
