"""A checkpoint's tokenizer (tokenizer.json through `tokenizers`), its special tokens, its
end-of-turn ids and its chat template (text/chat_template.py).

Control tokens come only from the template: in a chat, every string the caller gave (contents,
tool calls, tools, template kwargs) is tokenized as text, so user text `<|end|><|system|>`
cannot forge a turn. Encoding releases the GIL (the server tokenizes on worker threads).
"""

from __future__ import annotations

import json
import re
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
        added = self.backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        # the same tokenizer reading special-token text as plain text (for the caller's strings)
        self._as_text = tokenizers.Tokenizer.from_str(self.backend.to_str())
        self._as_text.encode_special_tokens = True
        # what a caller's string may not carry into a template as is: the special tokens' text
        # and the two marks that stand in for it while the template renders
        protected = sorted({t.content for t in added.values() if t.special} | {_OPEN, _CLOSE},
                           key=len, reverse=True)
        self._protected = re.compile("|".join(map(re.escape, protected)))
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
        # encode_batch releases the GIL while the Rust side works; encode does not
        [encoding] = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        ids = encoding.ids
        if add_special_tokens and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **template_kwargs) -> list[int]:
        """Renders the chat template and tokenizes it (only the template writes special
        tokens)."""
        return self.chat_prompt(messages, add_generation_prompt, tools, **template_kwargs)[0]

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **template_kwargs) -> tuple[list[int], str]:
        """The rendered conversation's token ids and its text. Special-token text inside the
        caller's strings is swapped for numbered marks while the template renders; the marks
        are then tokenized as the text they stand for, the template's own text as usual."""
        if self.chat_template is None:
            raise TemplateRenderError("this model has no chat template (tokenizer_config.json "
                                      "'chat_template' or chat_template.jinja)")
        held: list[str] = []

        def mark(match: re.Match) -> str:
            held.append(match.group(0))
            return f"{_OPEN}{len(held) - 1}{_CLOSE}"

        def guard(value):
            if isinstance(value, str):
                return self._protected.sub(mark, value)
            if isinstance(value, dict):
                return {guard(k): guard(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [guard(v) for v in value]
            return value

        text = self.chat_template.render(guard(messages), tools=guard(tools),
                                         add_generation_prompt=add_generation_prompt,
                                         **guard(template_kwargs))
        if not held:
            return self.encode(text, add_special_tokens=False), text
        pieces = _MARK.split(text)  # template text, a mark's number, template text, ...
        template = self.backend.encode_batch(pieces[::2], add_special_tokens=False)
        caller = self._as_text.encode_batch([held[int(i)] for i in pieces[1::2]],
                                            add_special_tokens=False)
        ids = list(template[0].ids)
        for said, after in zip(caller, template[1:]):
            ids += said.ids + after.ids
        return ids, _MARK.sub(lambda m: held[int(m.group(1))], text)


# marks for the caller's special-token text while a template renders: Unicode noncharacters,
# which a caller's occurrences of are themselves marked
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"
_MARK = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
