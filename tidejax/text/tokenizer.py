"""A checkpoint's tokenizer (tokenizer.json through `tokenizers`), its special tokens, its
end-of-turn ids and its chat template (text/chat_template.py)."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from tidejax.fields import ConfigError
from tidejax.text.chat_template import ChatTemplate, TemplateRenderError, token_text


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ConfigError(f"{path}: tokenizer file not found")
        self.backend = tokenizers.Tokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.special = {k: token_text(config.get(k)) for k in
                        ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.bos_id = self.token_id(self.special["bos_token"])
        self.eos_id = self.token_id(self.special["eos_token"])
        self.special_ids = frozenset(
            i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)
        try:
            self.chat_template: ChatTemplate | None = ChatTemplate.from_checkpoint(model_dir)
        except TemplateRenderError:
            self.chat_template = None
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

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **template_kwargs) -> list[int]:
        """Renders the chat template and tokenizes it (the template writes the special tokens)."""
        if self.chat_template is None:
            raise TemplateRenderError("this model has no chat template (tokenizer_config.json "
                                      "'chat_template' or chat_template.jinja)")
        text = self.chat_template.render(messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)
        return self.encode(text, add_special_tokens=False)
