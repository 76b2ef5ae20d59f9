"""The tiny family checkpoints the family contract (test_family_contract.py) and a family's own
module both test, each written and loaded once a session (once a worker under `pytest -n 2`), so
the steps an engine compiles serve both."""

from __future__ import annotations

import pytest

# a family's engine settings where it wants its own: DeepSeek-V3's 16-token prompt chunks, so
# the 32-token prompts prefill in two chunks of the step shape its short prompts (the sampling
# test's, residency's calibration) take too: one compiled prefill step, not two
TINY_ENGINE = {"deepseek_v3": {"prefill_chunk": 16}}


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """`tiny_family(family, config)` -> (checkpoint path, transformers' model, the engine over
    it): the family's named config (tests.support.tiny_models.FAMILIES) written with seed
    len(config) and loaded with TINY_ENGINE's settings the first time, shared after. Read only:
    a test leaves the engine idle, and writes beside the checkpoint into its own tmp_path."""
    import tidejax
    from tests.support.tiny_models import FAMILIES  # torch: imported by the tests that ask

    loaded = {}

    def get(family: str, config: str):
        if (family, config) not in loaded:
            writer, configs = FAMILIES[family]
            path = tmp_path_factory.mktemp(f"{family}-{config}")
            model = writer(path, seed=len(config), **configs[config])
            loaded[family, config] = (path, model,
                                      tidejax.load(path, engine=TINY_ENGINE.get(family, {})))
        return loaded[family, config]

    return get
