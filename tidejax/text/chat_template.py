"""Chat templates from a checkpoint, rendered as transformers renders them.

A checkpoint carries its template in tokenizer_config.json (`chat_template`, a string or a list of
named templates) or in chat_template.jinja. Templates are untrusted code from the model's
publisher, so they run in jinja2's immutable sandbox with the helpers transformers provides
(`raise_exception`, `tojson`, `strftime_now`, the `{% generation %}` tag) and the same
whitespace options (trim_blocks, lstrip_blocks). `Engine.generate(messages)` and the server both
render through `Tokenizer.chat_prompt`, which keeps special-token text in their strings as text.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRenderError(ValueError):
    """The template refused the conversation (its own `raise_exception`) or failed to render."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    only needs its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters; templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=8)
def _compile(source: str) -> tuple[jinja2.Template, frozenset[str]]:
    """The template and the variables it reads that it does not set itself (what a caller may
    pass: messages, tools, enable_thinking, ...)."""
    env = _environment()
    variables = jinja2.meta.find_undeclared_variables(env.parse(source))
    return env.from_string(source), frozenset(variables - set(env.globals))


def token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A checkpoint's chat template and the special tokens it may refer to; `variables`: the
    names it reads and does not set itself (where the server finds its thinking control)."""

    SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None,
                 origin: str = "<string>"):
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template, self.variables = _compile(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateRenderError(f"{origin}: chat template does not parse: {e}") from None

    @staticmethod
    def from_checkpoint(model_dir: str | Path) -> "ChatTemplate":
        """Reads chat_template.jinja, else tokenizer_config.json's `chat_template` (the "default"
        entry when it is a list of named templates)."""
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        special = {k: t for k in ChatTemplate.SPECIAL_TOKENS
                   if (t := token_text(config.get(k))) is not None}
        jinja_path = model_dir / "chat_template.jinja"
        if jinja_path.exists():
            return ChatTemplate(jinja_path.read_text(), special, str(jinja_path))
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            raise TemplateRenderError(
                f"{model_dir}: no chat template (chat_template.jinja, or 'chat_template' in "
                "tokenizer_config.json)")
        return ChatTemplate(source, special, f"{config_path}: chat_template")

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for `messages` (OpenAI-shaped dicts). `kwargs` are the request's
        chat_template_kwargs (e.g. enable_thinking=False / thinking=False)."""
        try:
            return self._template.render(
                messages=messages, tools=tools or None, documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs})
        except jinja2.TemplateError as e:
            raise TemplateRenderError(f"chat template: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise TemplateRenderError(f"chat template failed on this conversation: {e}") from None
