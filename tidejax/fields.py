"""One typed reader of JSON / TOML dicts whose errors name the file and the field."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tidejax.errors import ConfigError


def read_json(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


class Fields:
    """Typed access to a config dict that names the file and field on any error."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def req(self, name: str, kind: type = int) -> Any:
        if self.raw.get(name) is None:
            raise ConfigError(f"{self.source}: missing required field '{name}'")
        return self.cast(name, self.raw[name], kind)

    def opt(self, name: str, default: Any, kind: type = int) -> Any:
        value = self.raw.get(name)
        return default if value is None else self.cast(name, value, kind)

    def cast(self, name: str, value: Any, kind: type) -> Any:
        """kind: int, float (ints accepted), str, bool, list, dict, or tuple (a list of ints)."""
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if kind is tuple:
            if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
                raise ConfigError(
                    f"{self.source}: field '{name}' should be a list of integers, got {value!r}")
            return tuple(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise ConfigError(
                f"{self.source}: field '{name}' should be {kind.__name__}, got {value!r}")
        return value

    def one_of(self, name: str, default: str, supported: tuple[str, ...]) -> str:
        """A string field that must be one of `supported` (absent: default)."""
        value = self.opt(name, default, str)
        if value not in supported:
            raise ConfigError(f"{self.source}: field {name!r} = {value!r} is not supported "
                              f"({', '.join(supported)})")
        return value

    def token_ids(self, name: str) -> tuple[int, ...]:
        """A field holding one token id or a list of them (absent: none)."""
        value = self.raw.get(name)
        if value is None:
            return ()
        return self.cast(name, value, tuple) if isinstance(value, list) else (self.cast(name, value, int),)
