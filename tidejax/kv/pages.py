"""Host bookkeeping of the paged KV pool: which pages are free, which pages each sequence holds,
and which full pages are cached for a later prompt that starts with the same tokens.

Position p of a sequence lives in page `pages_of(seq)[p // page_size]`, row p % page_size. The
device pool itself is a family's cache pytree (leaves [n_pages, page_size, ...]); this table only
decides where things go, so the scheduler admits by free pages and preempts when they run short.

Prompt caching (sglang's mem_cache, three levels): a sequence -> its pages; a page -> the
sequences holding it (a reference count); a prefix index over full pages: the chained hash of
a page's tokens and every token before it (`block_hashes`) -> the page that holds their keys.
A prompt whose first pages' hashes are indexed shares those pages read-only (`match`, `share`);
it writes only past them, so a shared page is never written (only full pages are shared). A
page no sequence holds stays cached while it is indexed and is evicted least recently released
first when a sequence needs a page and none is unused (`grow`); `free` counts both kinds.

Where a sequence's lane keeps state beside the pool (DeepSeek-V4 and V4.1), an indexed page may
carry a snapshot of that state at its end (`attach`: a number the runners keep the copy under);
a match on the device alone then ends at the last page of the run that has one (`resumable`;
the scheduler's match may end past it where the host and disk tiers go on to one), and a
snapshot leaves with its page's index entry (evicted, or the index dropped): `take_dropped`
gives the numbers to forget.

With `spilling` on (kv/tiers.py: the host and disk tiers), an evicted page's block hash, page
and snapshot number go to `take_spilled` instead, so its contents are read out before the page
is written again (the plan's reads run before its step).
"""

from __future__ import annotations

import collections
import hashlib
import math

import numpy as np


def pages_for(n_tokens: int, page_size: int) -> int:
    return math.ceil(n_tokens / page_size)


def page_bucket(n_pages: int, limit: int) -> int:
    """The block-table width a step compiles for: the next power of two >= n_pages (at least 1),
    at most `limit`. Attention cost follows the pages held, with few compiled shapes."""
    return min(1 << max(n_pages - 1, 0).bit_length(), limit)


def block_hashes(tokens, page_size: int, known: list[bytes] = ()) -> list[bytes]:
    """The hash of each full page of `tokens`, chained: page i's covers its tokens and page
    i - 1's hash, so equal hashes mean equal tokens from position 0 on. `known`: the chain's
    first hashes, already computed over the same tokens."""
    out = list(known)
    ids = np.asarray(tokens, np.int64)
    for i in range(len(out), len(ids) // page_size):
        digest = hashlib.blake2b(ids[i * page_size:(i + 1) * page_size].tobytes(),
                                 digest_size=16)
        digest.update(out[-1] if out else b"")
        out.append(digest.digest())
    return out


class PageTable:
    def __init__(self, n_pages: int, page_size: int):
        if n_pages < 1 or page_size < 1:
            raise ValueError(f"a KV pool needs pages (got {n_pages} pages of {page_size} tokens)")
        self.n_pages, self.page_size = n_pages, page_size
        self._free = list(range(n_pages - 1, -1, -1))  # a stack: low page ids handed out first
        self._held: dict[int, list[int]] = {}
        self._refs = [0] * n_pages  # sequences holding each page
        self._index: dict[bytes, int] = {}  # block hash -> the page holding that block
        self._hash_of: dict[int, bytes] = {}  # an indexed page -> its block hash
        # indexed pages no sequence holds, least recently released first
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evictions = 0  # cached pages taken back for other positions
        self._snapshots: dict[int, int] = {}  # an indexed page -> its lane snapshot's number
        self._dropped: list[int] = []  # snapshots whose page left the index, not yet forgotten
        self.spilling = False  # evicted pages go to take_spilled (a host tier takes them)
        self._spilled: list[tuple[bytes, int, int | None]] = []

    @property
    def free(self) -> int:
        """Pages a sequence can take now: unused ones and cached ones no sequence holds."""
        return len(self._free) + len(self._idle)

    @property
    def in_use(self) -> int:
        """Pages some sequence holds."""
        return self.n_pages - self.free

    @property
    def cached(self) -> int:
        """Pages kept for the prefix index that no sequence holds (evicted when needed)."""
        return len(self._idle)

    @property
    def snapshots(self) -> int:
        """Lane snapshots kept with indexed pages."""
        return len(self._snapshots)

    def pages_of(self, seq: int) -> list[int]:
        return self._held.get(seq, [])

    def shortfall(self, seq: int, n_tokens: int) -> int:
        """Pages `seq` still needs to hold `n_tokens` positions."""
        return max(pages_for(n_tokens, self.page_size) - len(self.pages_of(seq)), 0)

    def match(self, hashes: list[bytes], snapshots: bool = False) -> list[int]:
        """The indexed pages of the longest run of `hashes` from the first (block_hashes); with
        `snapshots`, of the longest such run whose last page has a snapshot (none: [])."""
        pages = []
        for digest in hashes:
            page = self._index.get(digest)
            if page is None:
                break
            pages.append(page)
        return self.resumable(pages) if snapshots else pages

    def resumable(self, pages: list[int]) -> list[int]:
        """`pages` (match's) up to the last one that has a snapshot (none: [])."""
        end = len(pages)
        while end and pages[end - 1] not in self._snapshots:
            end -= 1
        return pages[:end]

    def snapshot_of(self, page: int) -> int:
        """The number of the snapshot an indexed page carries (match with `snapshots`)."""
        return self._snapshots[page]

    def attach(self, digest: bytes, snapshot: int) -> bool:
        """Keeps `snapshot` (a number) with the page indexed under `digest`, where it has none;
        returns whether it did."""
        page = self._index.get(digest)
        if page is None or page in self._snapshots:
            return False
        self._snapshots[page] = snapshot
        return True

    def take_dropped(self) -> list[int]:
        """The snapshots whose page left the index since the last call."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def takes(self, n_tokens: int, shared: list[int]) -> int:
        """Free pages a new sequence takes to hold `n_tokens` positions when it shares `shared`
        (match's pages): those it adds, and the shared ones no sequence holds now."""
        idle = sum(self._refs[page] == 0 for page in shared)
        return pages_for(n_tokens, self.page_size) - len(shared) + idle

    def share(self, seq: int, pages: list[int]) -> None:
        """A new sequence `seq` starts by holding `pages` (match's), read-only."""
        if seq in self._held:
            raise RuntimeError(f"sequence {seq} already holds pages")
        for page in pages:
            self._refs[page] += 1
            self._idle.pop(page, None)
        self._held[seq] = list(pages)

    def grow(self, seq: int, n_tokens: int) -> list[int]:
        """Gives `seq` pages for positions 0..n_tokens-1; returns its pages. Unused pages go
        first, then cached ones, least recently released first. Raises when the pool has too
        few free pages (callers check `shortfall` against `free` first)."""
        need = self.shortfall(seq, n_tokens)
        if need > self.free:
            raise RuntimeError(f"KV pool: {need} pages wanted, {self.free} free")
        held = self._held.setdefault(seq, [])
        for _ in range(need):
            page = self._free.pop() if self._free else self._evict()
            self._refs[page] = 1
            held.append(page)
        return held

    def shrink(self, seq: int, n_tokens: int) -> None:
        """`seq` lets go of its pages past those holding positions 0..n_tokens-1 (speculative
        decoding: pages that held only rejected drafts' keys), as `release` lets go of all."""
        held = self._held.get(seq, [])
        keep = pages_for(n_tokens, self.page_size)
        while len(held) > keep:
            self._let_go(held.pop())

    def _let_go(self, page: int) -> None:
        """One sequence fewer holds `page`: held by none, it stays cached where indexed, else
        goes back to the unused stack."""
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if page in self._hash_of:
                self._idle[page] = None
            else:
                self._free.append(page)

    def _evict(self) -> int:
        page, _ = self._idle.popitem(last=False)
        digest = self._hash_of.pop(page)
        del self._index[digest]
        snapshot = self._snapshots.pop(page, None)
        if self.spilling:
            self._spilled.append((digest, page, snapshot))
        elif snapshot is not None:
            self._dropped.append(snapshot)
        self.evictions += 1
        return page

    def take_spilled(self) -> list[tuple[bytes, int, int | None]]:
        """(block hash, page, snapshot number or None) of each page evicted since the last call
        while `spilling`: its contents stay in the pool until a step writes the page again."""
        spilled, self._spilled = self._spilled, []
        return spilled

    def indexed(self) -> list[tuple[bytes, int, int | None]]:
        """(block hash, page, snapshot number or None) of every indexed page, least recently used
        first: those no sequence holds in the order they were released, then those held."""
        held = [page for page in self._hash_of if page not in self._idle]
        return [(self._hash_of[page], page, self._snapshots.get(page))
                for page in [*self._idle, *held]]

    def publish(self, seq: int, hashes: list[bytes]) -> None:
        """Indexes the first len(hashes) pages of `seq` (their keys written, for the tokens the
        hashes cover) where no page holds that block yet."""
        for page, digest in zip(self.pages_of(seq), hashes):
            if page not in self._hash_of and digest not in self._index:
                self._index[digest], self._hash_of[page] = page, digest

    def release(self, seq: int) -> None:
        """`seq` lets go of its pages: an indexed page no other sequence holds stays cached, the
        sequence's last page the first evicted; any other goes back to the unused stack."""
        for page in reversed(self._held.pop(seq, [])):
            self._let_go(page)

    def drop_cached(self) -> None:
        """Forgets the prefix index (the pool's contents are gone: a rebuilt cache); cached
        pages no sequence holds become unused."""
        self._index.clear()
        self._hash_of.clear()
        self._dropped.extend(self._snapshots.values())
        self._snapshots.clear()
        # spilled pages not read out yet: their contents are gone with the cache
        self._dropped.extend(snap for _, _, snap in self._spilled if snap is not None)
        self._spilled.clear()
        self._free.extend(sorted(self._idle, reverse=True))
        self._idle.clear()
