"""A checkpoint's tokenizer (tokenizer.json through `tokenizers`) and its chat template.

The template is rendered as transformers renders it: a sandboxed jinja2 environment with
trim_blocks / lstrip_blocks, `raise_exception`, `tojson` and `strftime_now`, the special tokens as
variables, and the rendered text tokenized without adding special tokens again.
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path

import jinja2
import jinja2.sandbox
import tokenizers

from tidejax.config import ConfigError


class TemplateError(ValueError):
    """The chat template refused the messages (its raise_exception) or could not render."""


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialized by transformers
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ConfigError(f"{path}: tokenizer file not found")
        self.backend = tokenizers.Tokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.special = {k: _token_text(config.get(k)) for k in
                        ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.bos_id = self.token_id(self.special["bos_token"])
        self.eos_id = self.token_id(self.special["eos_token"])
        template = config.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if template_file.exists():
            template = template_file.read_text()
        if isinstance(template, list):  # named templates: take the default
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.add_bos = bool(config.get("add_bos_token", False))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.backend.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **template_kwargs) -> str:
        if not self.chat_template:
            raise TemplateError("this model has no chat template (tokenizer_config.json "
                                "'chat_template' or chat_template.jinja)")
        try:
            return _compile(self.chat_template).render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                **{k: v for k, v in self.special.items() if v is not None}, **template_kwargs)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=False)


def _raise(message: str):
    raise TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)
