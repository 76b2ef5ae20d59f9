"""A checkpoint's tokenizer, its special tokens, its end-of-turn ids and its chat template
(text/chat_template.py).

Two kinds of tokenizer file are read: tokenizer.json through `tokenizers`, and tiktoken.model
(base64 BPE ranks, Moonshot's Kimi checkpoints) through `tiktoken`, built as the checkpoint's own
tokenization_kimi.py builds it. Both sit behind one `Tokenizer`.

Control tokens come only from the template: in a chat, every string the caller gave (contents,
tool calls, tools, template kwargs) is tokenized as text, so user text `<|end|><|system|>`
cannot forge a turn. Encoding releases the GIL (the server tokenizes on worker threads).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from pathlib import Path

import tiktoken
import tokenizers

from tidejax.errors import ConfigError
from tidejax.text.chat_template import ChatTemplate, TemplateRenderError, token_text


class _TokenizersFile:
    """tokenizer.json through `tokenizers`."""

    def __init__(self, path: Path):
        self.model = tokenizers.Tokenizer.from_file(str(path))
        # the same tokenizer reading special-token text as plain text (for the caller's strings)
        self._as_text = tokenizers.Tokenizer.from_str(self.model.to_str())
        self._as_text.encode_special_tokens = True
        self.special = {i: t.content for i, t in self.model.get_added_tokens_decoder().items()
                        if t.special}
        self.vocab_size = self.model.get_vocab_size()
        self.sorts_tools = False
        self._added = {i: t.content for i, t in self.model.get_added_tokens_decoder().items()}
        decoder = json.loads(self.model.to_str()).get("decoder") or {}
        self._byte_level = "ByteLevel" in json.dumps(decoder)

    def encode(self, texts: list[str], controls: bool) -> list[list[int]]:
        """Each text's ids, special-token text as control tokens (`controls`) or as text; no
        post-processing. encode_batch releases the GIL while the Rust side works; encode does
        not."""
        model = self.model if controls else self._as_text
        return [e.ids for e in model.encode_batch(texts, add_special_tokens=False)]

    def encode_prompt(self, text: str) -> list[int]:
        """`text` with control tokens and the file's post-processor (e.g. a BOS template)."""
        [encoding] = self.model.encode_batch([text], add_special_tokens=True)
        return encoding.ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.model.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        return self.model.token_to_id(text)

    def token_bytes(self, token: int) -> bytes:
        """A byte-level vocabulary's token is its bytes through GPT-2's byte -> character map;
        an added token, or any other vocabulary's, is its decoded text."""
        piece = self.model.id_to_token(token)
        if token not in self._added and self._byte_level and piece is not None:
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            except KeyError:
                pass
        return self.model.decode([token], skip_special_tokens=False).encode("utf-8")


def _byte_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each byte as a printable character (the inverse map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_chars()


# Moonshot's tokenization_kimi.py (TikTokenTokenizer): the split pattern, the special ids that
# follow the ranks (256 reserved + 2), and the longest piece it hands tiktoken at once
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
KIMI_SPECIAL_IDS = 256 + 2
_MAX_CHARS, _MAX_RUN = 400_000, 25_000


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken ranks file: one "<base64 token> <rank>" a line, ranks 0..n-1 once each.
    (tiktoken.load.load_tiktoken_bpe caches files by their path in a temp dir, so a changed file
    at the same path would be read stale.)"""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ConfigError(f"{path}: line {number} is not '<base64 token> <rank>': "
                              f"{line[:80]!r}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ConfigError(f"{path}: the ranks are not 0..{len(ranks) - 1} once each "
                          "(a token or a rank is repeated or missing)")
    return ranks


def _pieces(text: str) -> list[str]:
    """`text` cut as tokenization_kimi.py cuts it before tiktoken: into chunks of at most
    400,000 characters, each cut where a run of whitespace or of non-whitespace passes 25,000
    characters (tiktoken slows down on longer runs)."""
    out = []
    for chunk in (text[i:i + _MAX_CHARS] for i in range(0, len(text), _MAX_CHARS)):
        start, run, space = 0, 0, chunk[:1].isspace()
        for i, ch in enumerate(chunk):
            if ch.isspace() != space:
                run, space = 1, not space
            else:
                run += 1
                if run > _MAX_RUN:
                    out.append(chunk[start:i])
                    start, run = i, 1
        out.append(chunk[start:])
    return out


class _TiktokenFile:
    """tiktoken.model through `tiktoken`, as tokenization_kimi.py builds it: Kimi's split
    pattern; special ids n..n+257 after the n ranks, named by tokenizer_config.json's
    `added_tokens_decoder` and `<|reserved_token_ID|>` otherwise. Like its apply_chat_template,
    the chat prompt sorts the keys of the tools."""

    def __init__(self, path: Path, config: dict, config_path: Path):
        ranks = read_ranks(path)
        n = len(ranks)
        decoder = config.get("added_tokens_decoder", {})
        if not isinstance(decoder, dict):
            raise ConfigError(f"{config_path}: field 'added_tokens_decoder' should be an object")
        named: dict[int, str] = {}
        for key, value in decoder.items():
            content = token_text(value)
            if not key.isdigit() or content is None:
                raise ConfigError(f"{config_path}: field 'added_tokens_decoder.{key}' should map "
                                  "a token id to a token (a string or {\"content\": ...})")
            if not n <= int(key) < n + KIMI_SPECIAL_IDS:
                raise ConfigError(
                    f"{config_path}: field 'added_tokens_decoder.{key}' is outside the special "
                    f"ids {n}..{n + KIMI_SPECIAL_IDS - 1} that follow the {n} ranks of {path}")
            named[int(key)] = content
        self.special = {i: named.get(i, f"<|reserved_token_{i}|>")
                        for i in range(n, n + KIMI_SPECIAL_IDS)}
        if len(set(self.special.values())) != KIMI_SPECIAL_IDS:
            raise ConfigError(f"{config_path}: field 'added_tokens_decoder' names a token twice")
        self._ids = {t: i for i, t in self.special.items()}
        self.encoding = tiktoken.Encoding(name=str(path), pat_str=KIMI_PAT_STR,
                                          mergeable_ranks=ranks, special_tokens=self._ids)
        self.vocab_size = self.encoding.n_vocab
        self.sorts_tools = True

    def encode(self, texts: list[str], controls: bool) -> list[list[int]]:
        """Each text's ids, special-token text as control tokens (`controls`) or as text
        (tiktoken releases the GIL while it encodes)."""
        out = []
        for text in texts:
            ids: list[int] = []
            for piece in _pieces(text):
                ids += (self.encoding.encode(piece, allowed_special="all") if controls
                        else self.encoding.encode_ordinary(piece))
            out.append(ids)
        return out

    def encode_prompt(self, text: str) -> list[int]:
        """`text` with control tokens (a tiktoken file has no post-processor)."""
        return self.encode([text], controls=True)[0]

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special]
        return self.encoding.decode(ids)  # errors="replace": a cut character is U+FFFD

    def token_id(self, text: str) -> int | None:
        if text in self._ids:
            return self._ids[text]
        try:
            return self.encoding.encode_single_token(text)
        except KeyError:
            return None

    def token_bytes(self, token: int) -> bytes:
        if token in self.special:
            return self.special[token].encode("utf-8")
        return self.encoding.decode_single_token_bytes(token)


def _sorted_keys(value):
    if isinstance(value, dict):
        return {k: _sorted_keys(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        if (model_dir / "tokenizer.json").exists():
            self.backend = _TokenizersFile(model_dir / "tokenizer.json")
        elif (model_dir / "tiktoken.model").exists():
            self.backend = _TiktokenFile(model_dir / "tiktoken.model", config, config_path)
        else:
            raise ConfigError(f"{model_dir}: tokenizer file not found (tokenizer.json or "
                              "tiktoken.model)")
        self.special = {k: token_text(config.get(k)) for k in
                        ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.bos_id = self.token_id(self.special["bos_token"])
        self.eos_id = self.token_id(self.special["eos_token"])
        self.special_tokens: dict[int, str] = self.backend.special  # id -> text
        self.special_ids = frozenset(self.special_tokens)
        # what a caller's string may not carry into a template as is: the special tokens' text
        # and the two marks that stand in for it while the template renders
        protected = sorted(set(self.special_tokens.values()) | {_OPEN, _CLOSE},
                           key=len, reverse=True)
        self._protected = re.compile("|".join(map(re.escape, protected)))
        try:
            self.chat_template: ChatTemplate | None = ChatTemplate.from_checkpoint(model_dir)
        except TemplateRenderError:
            self.chat_template = None
        self.add_bos = bool(config.get("add_bos_token", False))

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.backend.token_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text` as the checkpoint reads a raw prompt: special-token text is a control token;
        with `add_special_tokens`, the file's post-processor and add_bos_token apply."""
        if not add_special_tokens:
            return self.backend.encode([text], controls=True)[0]
        ids = self.backend.encode_prompt(text)
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token: int) -> bytes:
        """One token's bytes (a piece of a UTF-8 character where the token is one): what
        logprobs report beside its text."""
        return self.backend.token_bytes(token)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **template_kwargs) -> list[int]:
        """Renders the chat template and tokenizes it (only the template writes special
        tokens)."""
        return self.chat_prompt(messages, add_generation_prompt, tools, **template_kwargs)[0]

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, continue_final: bool = False,
                    **template_kwargs) -> tuple[list[int], str]:
        """The rendered conversation's token ids and its text. Special-token text inside the
        caller's strings is swapped for numbered marks while the template renders; the marks
        are then tokenized as the text they stand for, the template's own text as usual.
        `continue_final`: the last message (an assistant's) is continued, the text cut where
        its content ends (transformers' continue_final_message: a tag after the content, the
        text cut at it, and before the whitespace the template trimmed)."""
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

        if tools and self.backend.sorts_tools:
            tools = _sorted_keys(tools)
        guarded = guard(messages)
        if continue_final:
            guarded[-1] = {**guarded[-1], "content": (guarded[-1].get("content") or "") + _CONTINUE}
        text = self.chat_template.render(guarded, tools=guard(tools),
                                         add_generation_prompt=add_generation_prompt
                                         and not continue_final, **guard(template_kwargs))
        if continue_final:
            at = text.rfind(_CONTINUE.strip())
            if at < 0:
                raise TemplateRenderError("the last message cannot be continued: the chat "
                                          "template does not write its text")
            text = text[:at] if text.startswith(_CONTINUE, at) else text[:at].rstrip()
        if not held:
            return self.encode(text, add_special_tokens=False), text
        pieces = _MARK.split(text)  # template text, a mark's number, template text, ...
        template = self.backend.encode(pieces[::2], controls=True)
        caller = self.backend.encode([held[int(i)] for i in pieces[1::2]], controls=False)
        ids = list(template[0])
        for said, after in zip(caller, template[1:]):
            ids += said + after
        return ids, _MARK.sub(lambda m: held[int(m.group(1))], text)


# marks for the caller's special-token text while a template renders: Unicode noncharacters,
# which a caller's occurrences of are themselves marked
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"
_MARK = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
_CONTINUE = f"{_OPEN}continue{_CLOSE} "  # after the content of a message to be continued
