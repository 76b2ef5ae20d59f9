"""Incremental detokenization and stop strings.

Byte-level BPE tokens can end inside a UTF-8 character, so text is released only once it decodes
cleanly; text that might be the start of a stop string is held back until it cannot be.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """push(token) -> the new text it completes ("" while a character is incomplete)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already released

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
            return ""
        new, self.emitted = text[self.emitted:], len(text)
        return new


class StopMatcher:
    """Feeds text through; stops at the first stop string, which is not part of the output."""

    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Returns the text safe to release now; sets .stopped when a stop string appeared."""
        if self.stopped:
            return ""
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        hold = max((k for s in self.stops for k in range(1, len(s))
                    if self.pending.endswith(s[:k])), default=0)
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
