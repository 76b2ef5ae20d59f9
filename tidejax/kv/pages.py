"""Host bookkeeping of the paged KV pool: which pages are free, which pages each sequence holds.

Position p of a sequence lives in page `pages_of(seq)[p // page_size]`, row p % page_size. The
device pool itself is a family's cache pytree (leaves [n_pages, page_size, ...]); this table only
decides where things go, so the scheduler admits by free pages and preempts when they run short.
"""

from __future__ import annotations

import math


def pages_for(n_tokens: int, page_size: int) -> int:
    return math.ceil(n_tokens / page_size)


def page_bucket(n_pages: int, limit: int) -> int:
    """The block-table width a step compiles for: the next power of two >= n_pages (at least 1),
    at most `limit`. Attention cost follows the pages held, with few compiled shapes."""
    return min(1 << max(n_pages - 1, 0).bit_length(), limit)


class PageTable:
    def __init__(self, n_pages: int, page_size: int):
        if n_pages < 1 or page_size < 1:
            raise ValueError(f"a KV pool needs pages (got {n_pages} pages of {page_size} tokens)")
        self.n_pages, self.page_size = n_pages, page_size
        self._free = list(range(n_pages - 1, -1, -1))  # a stack: low page ids handed out first
        self._held: dict[int, list[int]] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.n_pages - len(self._free)

    def pages_of(self, seq: int) -> list[int]:
        return self._held.get(seq, [])

    def shortfall(self, seq: int, n_tokens: int) -> int:
        """Pages `seq` still needs to hold `n_tokens` positions."""
        return max(pages_for(n_tokens, self.page_size) - len(self.pages_of(seq)), 0)

    def grow(self, seq: int, n_tokens: int) -> list[int]:
        """Gives `seq` pages for positions 0..n_tokens-1; returns its pages. Raises when the pool
        has too few free pages (callers check `shortfall` against `free` first)."""
        need = self.shortfall(seq, n_tokens)
        if need > len(self._free):
            raise RuntimeError(f"KV pool: {need} pages wanted, {len(self._free)} free")
        held = self._held.setdefault(seq, [])
        held.extend(self._free.pop() for _ in range(need))
        return held

    def release(self, seq: int) -> None:
        self._free.extend(reversed(self._held.pop(seq, [])))
