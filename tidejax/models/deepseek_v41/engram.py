"""Engram n-gram memory, host side (DeepSeek-V4.1).

The Engram hash ids depend only on token ids, so the host computes them ahead of each step and
gathers the table rows there; the tables (about 94 GiB each in the released model) stay in host
memory, memory-mapped, and never reach the accelerator. The device side (the gate that writes a
looked-up row into the residual streams) lives in model.py. `EngramInputs` is the family's
`host_inputs`: one EngramHasher per lane (addressed by position) hashes the step's tokens and the
rows are gathered from the host tables before the step runs.

Hashing, as the reference defines it:
- token map: each tokenizer id is decoded alone and normalized (NFKC, NFD, strip accents,
  lowercase, whitespace runs to one space, strip); ids that normalize alike share a compressed id,
  numbered in order of first appearance.
- for position p, tok_s = compressed id at p - s (s = 0..N-1); once p < s or a dead (masked) token
  is met, this and every larger shift use the pad id.
- h = tok_0 * m_0, then h ^= tok_i * m_i; the (i+1)-gram id of head k is h mod prime[i-1][k], plus
  the row offset of that (n-gram, head) column inside the layer's table.
"""

from __future__ import annotations

import dataclasses

import numpy as np

DEAD = -1  # a masked position in the history: n-grams never span it


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def layer_primes(layer_count: int, max_ngram: int, heads: int, vocab_size: int) -> np.ndarray:
    """Primes [layers, max_ngram - 1, heads]: for each layer, n-gram size and head the next prime
    above a value that restarts at vocab_size - 1 for every n-gram size; no prime is used twice."""
    seen: set[int] = set()
    out = np.zeros((layer_count, max_ngram - 1, heads), np.int64)
    for layer in range(layer_count):
        for n in range(max_ngram - 1):
            current = vocab_size - 1
            for k in range(heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                out[layer, n, k] = current
    return out


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed_vocab: int) -> np.ndarray:
    """Odd multipliers [layers, max_ngram], bounded so that id * multiplier fits in int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64)
            for layer in layer_ids]
    return np.stack(rows) * 2 + 1


def compressed_token_map(tokenizer) -> np.ndarray:
    """tokenizer id -> compressed Engram id, for a `tokenizers.Tokenizer`."""
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # keeps a token that is exactly one space from stripping to ""
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])
    keys: dict[str, int] = {}
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    out = np.zeros(size, np.int64)
    for token_id in range(size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 byte token: keyed by its raw form
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        out[token_id] = keys.setdefault(key, len(keys))
    return out


@dataclasses.dataclass(frozen=True)
class EngramLayout:
    """Everything the hashing needs, fixed by the config and the tokenizer."""

    layer_ids: tuple[int, ...]
    max_ngram: int
    heads: int
    token_map: np.ndarray  # [vocab] int64
    pad_id: int  # compressed id used for blocked look-back slots
    multipliers: np.ndarray  # [layers, max_ngram] int64
    primes: np.ndarray  # [layers, max_ngram - 1, heads] int64
    offsets: np.ndarray  # [layers, (max_ngram - 1) * heads] row offset of each column

    @staticmethod
    def build(layer_ids, max_ngram: int, heads: int, vocab_size: int, token_map: np.ndarray,
              pad_token: int, compressed_vocab: int, num_embeddings, source: str) -> "EngramLayout":
        """Checks the tokenizer-derived map and the table sizes against the config (`source`)."""
        layer_ids = tuple(layer_ids)
        found = int(token_map.max()) + 1 if token_map.size else 0
        if found != compressed_vocab:
            raise ValueError(f"{source}: field 'engram_compressed_vocab_size' = {compressed_vocab}, "
                             f"but the tokenizer's normalized vocabulary has {found} entries")
        primes = layer_primes(len(layer_ids), max_ngram, heads, vocab_size)
        sizes = primes.reshape(len(layer_ids), -1)
        rows = tuple(int(s) for s in sizes.sum(-1))
        if tuple(num_embeddings) != rows:
            raise ValueError(f"{source}: field 'engram_num_embeddings' = {list(num_embeddings)}, "
                             f"the hash layout needs {list(rows)}")
        offsets = np.cumsum(sizes, axis=-1) - sizes
        return EngramLayout(layer_ids, max_ngram, heads, token_map.astype(np.int64),
                            int(token_map[pad_token]), hash_multipliers(layer_ids, max_ngram, found),
                            primes, offsets)

    def hash_ids(self, history: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """history [P] compressed ids by absolute position (DEAD = masked), positions [S] ->
        row ids [S, layers, (max_ngram - 1) * heads], offsets included."""
        positions = np.asarray(positions, np.int64)
        blocked = np.zeros(positions.shape, bool)
        tokens = []
        for shift in range(self.max_ngram):
            source = history[np.maximum(positions - shift, 0)]
            blocked |= (positions < shift) | (source == DEAD)
            tokens.append(np.where(blocked, self.pad_id, source))
        tokens = np.stack(tokens, -1)  # [S, N]
        products = tokens[:, None, :] * self.multipliers[None]  # [S, L, N]
        rolling, cols = products[..., 0], []
        for i in range(1, self.max_ngram):
            rolling = rolling ^ products[..., i]
            cols.append(rolling[..., None] % self.primes[None, :, i - 1])  # [S, L, heads]
        return np.concatenate(cols, -1) + self.offsets[None]


class EngramHasher:
    """Per-sequence hashing across prefill and decode: keeps the compressed-id history by absolute
    position, so a chunk that starts mid-sequence sees the same look-back as a one-shot prefill."""

    def __init__(self, layout: EngramLayout):
        self.layout = layout
        self.history = np.full(0, DEAD, np.int64)

    def __call__(self, token_ids, start: int, live=None) -> np.ndarray:
        """token_ids [S] at positions start..start+S-1; live [S] bool (False = dead) ->
        row ids [S, layers, cols]."""
        ids = np.asarray(token_ids, np.int64)
        positions = start + np.arange(len(ids))
        end = start + len(ids)
        if len(self.history) < end:
            grown = np.full(max(end, 2 * len(self.history)), DEAD, np.int64)
            grown[:len(self.history)] = self.history
            self.history = grown
        compressed = self.layout.token_map[ids]
        if live is not None:
            compressed = np.where(np.asarray(live, bool), compressed, DEAD)
        self.history[positions] = compressed
        return self.layout.hash_ids(self.history, positions)


def gather_rows(tables, hash_ids: np.ndarray) -> np.ndarray:
    """tables: one [rows, head_dim] array (or memory map) per Engram layer, float rows or
    (fp8 values, e8m0-style scales per 32 channels) pairs; hash_ids [..., layers, cols] ->
    float32 [..., layers, cols, head_dim]."""
    out = []
    for layer, table in enumerate(tables):
        ids = hash_ids[..., layer, :]
        if isinstance(table, tuple):
            values, scales = table
            rows = values[ids].astype(np.float32)
            block = rows.shape[-1] // scales.shape[-1]
            rows = rows.reshape(*rows.shape[:-1], -1, block) * scales[ids].astype(np.float32)[..., None]
            out.append(rows.reshape(*ids.shape, -1))
        else:
            out.append(np.asarray(table[ids], np.float32))
    return np.stack(out, axis=-3)


def engram_rows(ck, hashers: list[EngramHasher], tokens: np.ndarray, starts,
                token_mask: np.ndarray | None = None):
    """Host side of Engram for a loaded checkpoint `ck` (weights.V41Checkpoint): tokens [b, t] at
    positions starts[r].. -> float32 [b, t, engram layers, cols, e] table rows (None for a model
    without Engram)."""
    if not ck.cfg.engram_layers:
        return None
    ids = np.stack([h(row, int(s), None if token_mask is None else token_mask[r])
                    for r, (h, row, s) in enumerate(zip(hashers, np.asarray(tokens), starts))])
    return gather_rows(ck.engram_tables, ids)


def new_hashers(ck, batch: int) -> list[EngramHasher]:
    return [EngramHasher(ck.engram_layout) for _ in range(batch)] if ck.engram_layout else []


class EngramInputs:
    """The Engram rows of a step, from one hasher per row of the batch (a lane or a sequence)."""

    def __init__(self, checkpoint, batch: int):
        self.checkpoint = checkpoint
        self.hashers = new_hashers(checkpoint, batch)

    def rows(self, tokens: np.ndarray, starts, mask: np.ndarray, lanes=None):
        """tokens [b, t] at positions starts[r].. (mask: real tokens); lanes: which hasher serves
        each row (default: row r -> hasher r)."""
        hashers = self.hashers if lanes is None else [self.hashers[i] for i in lanes]
        return engram_rows(self.checkpoint, hashers, tokens, starts, mask)

    def read_lane(self, lane: int) -> np.ndarray:
        """What a preempted sequence keeps of its lane's hasher: the compressed-id history."""
        return self.hashers[lane].history.copy()

    def write_lane(self, lane: int, history: np.ndarray) -> None:
        """Gives `lane`'s hasher a history read by `read_lane` (a resumed sequence's look-back)."""
        self.hashers[lane].history = history.copy()


def host_inputs(cfg, checkpoint, batch: int):
    return EngramInputs(checkpoint, batch) if cfg.engram_layers else None
