"""The tiny family checkpoints, and the servers over the tiny chat checkpoints, that the family
contract (test_family_contract.py) and a family's own module both test, each written and loaded
once a session (once a worker under `pytest -n 2`), so the steps an engine compiles serve both."""

from __future__ import annotations

import asyncio
import contextlib

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


@pytest.fixture(scope="session")
def chat_server(tmp_path_factory):
    """`chat_server(family)` -> (checkpoint path, base URL, the engine): the app over the family's
    tiny chat checkpoint (tests/support/chat_models.py: its published template, weights that write
    reasoning and then a call of get_weather in its format) on a loopback port, started the first
    time, shared after, stopped at the session's end."""
    import tidejax
    from tidejax.config import EngineConfig
    from tidejax.runtime.client import LocalEngineClient
    from tidejax.server.app import Server
    from tests.support.chat_models import write_chat_model
    from tests.support.server_fixtures import serve_app

    started = {}
    with contextlib.ExitStack() as stack:

        def get(family: str):
            if family not in started:
                path = write_chat_model(family, tmp_path_factory.mktemp(f"{family}-chat"))
                # prompt chunks of 64: one prefill shape; warmup off: each shape compiles when
                # first met
                engine = tidejax.load(path, engine={"lanes": 2, "max_context": 512,
                                                    "prefill_chunk": 64, "warmup": False})
                client = LocalEngineClient(engine)
                asyncio.run(client.start())
                stack.callback(client.stop)  # after the app's exit: the stack unwinds in reverse
                server = Server(EngineConfig().with_overrides({"model": {"path": str(path)}}))
                server.attach(client)
                started[family] = path, stack.enter_context(serve_app(server)), engine
            return started[family]

        yield get
