"""The errors tidejax raises on purpose, one tree under `TidejaxError`.

    ConfigError      a profile, config.json or tokenizer file that cannot be used (names the
                     file and the field)
    CheckpointError  weights that do not fit the model (names the file and the tensor)
    RequestError     a request the engine will not run; `field` names what to fix. The server
                     answers it with a 400, and nothing else with a 400.
    EngineError      the engine failed a request it took; the message is for the log (the
                     server answers a 500 that does not repeat it)

A ValueError or any other exception from inside the engine is a bug, not the caller's fault.
"""

from __future__ import annotations


class TidejaxError(Exception):
    """The base of every error tidejax raises on purpose."""


class ConfigError(TidejaxError):
    """A config.json or profile that cannot be used; the message names the file and the field."""


class CheckpointError(TidejaxError):
    """A checkpoint that cannot be loaded; the message names the file and the tensor."""


class RequestError(TidejaxError):
    """A request that cannot run as asked: `field` names the request field (None: the request
    as a whole), `code` an optional machine-readable reason (OpenAI's error `code`)."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.field, self.code = message, field, code


class EngineError(TidejaxError):
    """The engine could not serve a request it accepted (a failed step, a failed state)."""
