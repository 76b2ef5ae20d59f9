"""Incremental detokenization and stop strings.

Byte-level BPE tokens can end inside a UTF-8 character, so text is released only once it decodes
cleanly; text that might be the start of a stop string is held back until it cannot be.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """push(token) -> the new text it completes ("" while a character is incomplete).

    Special tokens are dropped, except those in `keep` (e.g. tool-call markers a parser needs).
    """

    def __init__(self, tokenizer, keep: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.dropped = tokenizer.special_ids - keep
        self.ids: list[int] = []
        # Decode only from `prefix` on: ids[prefix:read] decoded to text already released, so the
        # cost of a token does not grow with the length of the output.
        self.prefix = self.read = 0

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        if token_id in self.dropped:
            return ""
        self.ids.append(token_id)
        text = self._decode(self.prefix)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
            return ""
        new = text[len(self._decode(self.prefix, self.read)):]
        self.prefix, self.read = self.read, len(self.ids)
        return new

    def flush(self) -> str:
        """At the end: whatever is still held (an unfinished character decodes to U+FFFD)."""
        text = self._decode(self.prefix)
        new = text[len(self._decode(self.prefix, self.read)):]
        self.prefix = self.read = len(self.ids)
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
