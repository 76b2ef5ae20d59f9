"""Engram n-gram memory (DeepSeek-V4.1): the hash layout, the hashing inside the step and the
rows read from the tables in host memory.

The hash ids depend only on token ids, so the step computes them on the device from the tokens
it already holds (a step's input tokens are the previous step's output: the decode stays
pipelined). Each lane keeps the compressed ids of its last max_ngram - 1 positions (V41Lanes'
`engram` ring, saved and restored with the lane's rows on preemption), so a chunk that starts
mid-sequence sees the same look-back as a one-shot prefill. The tables (about 94 GiB each in the
released model) stay in host memory: the step reads the rows its ids name one at a time, as an
exact miss reads an expert's row (residency.state.fetch_row), and never copies a table whole.
`EngramLayout.hash_ids` (numpy, int64) is the reference `hash_ids` (jnp, int64 arithmetic in
uint32 pairs: no x64) is checked against. The gate that writes a row into the residual streams
lives in model.py.

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

import jax
import jax.numpy as jnp
import numpy as np

from tidejax import parallel
from tidejax.errors import ConfigError
from tidejax.residency.state import fetch_row, write_row

DEAD = -1  # a masked position in the reference's history: n-grams never span it


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
            raise ConfigError(f"{source}: field 'engram_compressed_vocab_size' = "
                              f"{compressed_vocab}, but the tokenizer's normalized vocabulary has "
                              f"{found} entries")
        primes = layer_primes(len(layer_ids), max_ngram, heads, vocab_size)
        sizes = primes.reshape(len(layer_ids), -1)
        rows = tuple(int(s) for s in sizes.sum(-1))
        if tuple(num_embeddings) != rows:
            raise ConfigError(f"{source}: field 'engram_num_embeddings' = {list(num_embeddings)}, "
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EngramTables:
    """What the step needs to hash and look up, placed once at load: the token map [vocab] and
    each compressed id's products with the layers' multipliers, as (hi, lo) uint32 halves of the
    int64 [compressed, layers, max_ngram], the primes [layers, max_ngram - 1, heads] and column
    offsets [layers, cols] on the device; the tables, one {"values": [rows, e]} (float) or
    {"values": e4m3 [rows, e], "scales": [rows, e / 32]} per Engram layer, in host memory."""

    token_map: jax.Array
    products_hi: jax.Array
    products_lo: jax.Array
    primes: jax.Array
    offsets: jax.Array
    tables: tuple
    pad_id: int = dataclasses.field(metadata=dict(static=True))

    @property
    def window(self) -> int:
        """Look-back positions a lane keeps (max_ngram - 1)."""
        return self.products_hi.shape[-1] - 1

    @staticmethod
    def place(layout: EngramLayout, tables, vocab_size: int) -> "EngramTables":
        """`tables`: per layer the checkpoint's [rows, e] array or (e4m3 values, scales) pair.
        Ids of the model's vocabulary past the tokenizer's (a synthetic's `--vocab` rows) hash
        as the pad id."""
        if layout.primes.max() >= 2**31 or sum(int(t.shape[0]) for t in _values(tables)) >= 2**31:
            raise ValueError("Engram primes and table rows must be below 2**31 (int32 row ids)")
        compressed = np.arange(int(layout.token_map.max()) + 1, dtype=np.int64)
        products = compressed[:, None, None] * layout.multipliers[None]  # fits int64 (bounded)
        halves = products.view(np.uint32).reshape(*products.shape, 2)  # little endian: lo, hi
        token_map = np.full(max(vocab_size, len(layout.token_map)), layout.pad_id, np.int32)
        token_map[:len(layout.token_map)] = layout.token_map
        device = parallel.replicated((token_map, halves[..., 1].copy(),
                                      halves[..., 0].copy(), layout.primes.astype(np.uint32),
                                      layout.offsets.astype(np.int32)))
        host = tuple({"values": t[0], "scales": t[1]} if isinstance(t, tuple) else {"values": t}
                     for t in tables)
        host = parallel.put(host, jax.tree.map(lambda _: (None, None), host), memory="host")
        return EngramTables(*device, host, layout.pad_id)


def _values(tables):
    return [t[0] if isinstance(t, tuple) else t for t in tables]


def _mod(hi, lo, p):
    """(hi * 2**32 + lo) mod p for uint32 arrays and primes p < 2**31: the high word's
    remainder, then the low word's bits shifted in one at a time (2r + 1 < 2**32)."""
    r = hi % p
    for bit in range(31, -1, -1):
        r = (r << 1) | ((lo >> bit) & 1)
        r = jnp.where(r >= p, r - p, r)
    return r


def hash_ids(eng: EngramTables, tokens, positions, mask, history):
    """tokens, positions, mask [b, t] (a row's chunk contiguous from positions[:, 0], its real
    tokens first); history [b, W] the compressed ids of each row's positions before the chunk
    (slot = position mod W, W = max_ngram - 1) -> (row ids [b, t, layers, cols] int32, offsets
    included, as EngramLayout.hash_ids gives them; the history after the chunk's real tokens)."""
    w, t = eng.window, tokens.shape[1]
    start = positions[:, :1]
    past = jnp.take_along_axis(history, (start - w + jnp.arange(w)) % w, 1)  # positions start-w..
    seq = jnp.concatenate([past, eng.token_map[tokens]], 1)  # [b, w + t]: index i = start - w + i
    j = jnp.arange(t)
    cols = []
    for shift in range(w + 1):  # a look-back before position 0 takes the pad id
        ids = jnp.where(positions >= shift, seq[:, w + j - shift], eng.pad_id)
        hi, lo = eng.products_hi[ids, :, shift], eng.products_lo[ids, :, shift]  # [b, t, layers]
        if shift == 0:
            rolling = hi, lo
            continue
        rolling = rolling[0] ^ hi, rolling[1] ^ lo
        cols.append(_mod(rolling[0][..., None], rolling[1][..., None], eng.primes[:, shift - 1]))
    row_ids = jnp.concatenate(cols, -1).astype(jnp.int32) + eng.offsets
    end = start[:, 0] + jnp.sum(mask, 1)  # one past the last real position
    last = jax.vmap(lambda s, n: jax.lax.dynamic_slice(s, (n,), (w,)))(seq, end - start[:, 0])
    history = jnp.take_along_axis(last, (jnp.arange(w) - end[:, None] + w) % w, 1)
    return row_ids, history


def prompt_rows(layout: EngramLayout, tables: list, context, tokens, start: int,
                size: int) -> tuple:
    """The rows a prompt chunk's positions start..start + size - 1 name, hashed and read on the
    host: a chunk's tokens are known there, and the step's own read (gather_rows) goes one row
    at a time, 49,152 iterations for a 2,048-token chunk (bench/RESULTS.md, 2026-12-04).
    tokens: the chunk's (the rest of `size` is padding, hashed as dead positions); context: the
    sequence's tokens before start; tables: per Engram layer [rows, e] or (e4m3 values, scales)
    as stored. Per layer {"values": [size * cols, e], "scales"?: [size * cols, e / 32]}, in
    gather_rows' order (dequantized() reads both)."""
    def compressed(ids):
        ids = np.asarray(ids, np.int64)
        known = ids < len(layout.token_map)  # a synthetic's ids past the tokenizer's: the pad id
        return np.where(known, layout.token_map[np.where(known, ids, 0)], layout.pad_id)

    before = list(context)[max(0, start - (layout.max_ngram - 1)):start]
    if len(before) < min(start, layout.max_ngram - 1):
        raise ValueError(f"a prompt chunk at position {start} needs the {layout.max_ngram - 1} "
                         f"tokens before it (its context), got {len(context)}")
    history = np.full(start + size, DEAD, np.int64)
    history[start - len(before):start] = compressed(before)
    history[start:start + len(tokens)] = compressed(tokens)
    ids = layout.hash_ids(history, np.arange(start, start + size))  # [size, layers, cols]
    rows = []
    for layer, table in enumerate(tables):
        flat = ids[:, layer].reshape(-1)
        values, scales = table if isinstance(table, tuple) else (table, None)
        rows.append({"values": values[flat]} if scales is None
                    else {"values": values[flat], "scales": scales[flat]})
    return tuple(rows)


def gather_rows(eng: EngramTables, ids):
    """ids [b, t, layers, cols] -> float32 rows [b, t, layers, cols, e], read from the tables in
    host memory one row of every layer at a time (fetch_row), then dequantized on the device
    (e4m3 values times their scale per block of e / scales channels)."""
    b, t, layers, c = ids.shape
    flat = ids.transpose(2, 0, 1, 3).reshape(layers, -1)  # [layers, m]
    out = tuple(jax.tree.map(lambda leaf: jnp.zeros((flat.shape[1], *leaf.shape[1:]), leaf.dtype),
                             table) for table in eng.tables)

    def body(i, out):
        return tuple(write_row(o, i, fetch_row(table, flat[layer, i]))
                     for layer, (o, table) in enumerate(zip(out, eng.tables)))

    out = jax.lax.fori_loop(0, flat.shape[1], body, out)
    return dequantized(out, (b, t, c))


def dequantized(rows: tuple, shape: tuple) -> jax.Array:
    """Per Engram layer {"values": [m, e], "scales"?: [m, e / 32]} rows as read from its table,
    m = b * t * cols -> float32 [b, t, layers, cols, e] (shape = (b, t, cols))."""
    out = []
    for got in rows:
        values = got["values"].astype(jnp.float32)
        if "scales" in got:
            scales = got["scales"].astype(jnp.float32)
            values = (values.reshape(*scales.shape, -1) * scales[..., None]).reshape(values.shape)
        out.append(values.reshape(*shape, -1))
    return jnp.stack(out, 2)
