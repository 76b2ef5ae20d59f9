"""A plain DeepSeek-V4.1 runner for the golden tests, every expert resident: the jitted step,
a full forward for scoring and a greedy loop through the cache (the engine serves the family
through tidejax.models.deepseek_v41.family).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tidejax.models.deepseek_v41.config import V41Config
from tidejax.kv.paged import PagedCache
from tidejax.models.deepseek_v41.model import DeepseekV41, V41Lanes, V41Pages
from tidejax.models.deepseek_v41.weights import V41Checkpoint
from tidejax.residency.serve import ServeOptions


PAGE_SIZE = 16  # small pages: a golden sequence spans several of them


def new_cache(cfg: V41Config, rows: int, max_len: int, dtype=jnp.float32):
    """(cache, block table [rows, P]): a pool of pages for `rows` sequences of up to max_len
    positions, each row's pages interleaved with the others' (row r holds pages r, r + rows,
    ...), and one lane of rings and buffers a row."""
    per_row = -(-max_len // PAGE_SIZE)
    table = (np.arange(per_row)[None] * rows + np.arange(rows)[:, None]).astype(np.int32)
    return (PagedCache(V41Pages.create(cfg, rows * per_row, PAGE_SIZE, dtype),
                       V41Lanes.create(cfg, rows, dtype)), table)


@functools.lru_cache(maxsize=None)
def step_fn(cfg: V41Config, kernel: str = "auto"):
    """jit(params, cache, table [b, P], tokens [b, t], positions [b, t], token_mask [b, t],
    engram (the checkpoint's EngramTables), experts) -> (logits [b, t, vocab] float32, cache,
    experts); the cache is
    donated. Every expert is resident here (the engine serves budgets through
    tidejax.residency)."""
    model = DeepseekV41(cfg, ServeOptions(kernel=kernel, swiglu_limit=cfg.swiglu_limit,
                                          all_resident=True))

    def step(params, cache, table, tokens, positions, token_mask, engram, experts):
        return model.apply(params, tokens, positions, token_mask, cache, table, experts, engram)

    return jax.jit(step, donate_argnums=(1,))




def full_logits(ck: V41Checkpoint, token_ids, kernel: str = "auto") -> np.ndarray:
    """One forward over a sequence: [T] ids -> [T, vocab] float32."""
    ids = np.asarray(token_ids, np.int32)[None]
    t = ids.shape[1]
    positions = np.arange(t, dtype=np.int32)[None]
    logits, _, _ = step_fn(ck.cfg, kernel)(ck.params, *new_cache(ck.cfg, 1, t), ids, positions,
                                           np.ones_like(ids, bool), ck.engram, ck.experts)
    return np.asarray(logits[0])


class Sequence:
    """One sequence through the cache: prefill chunks and decode steps at increasing positions."""

    def __init__(self, ck: V41Checkpoint, max_len: int, kernel: str = "auto",
                 cache_dtype=jnp.float32):
        self.ck, self.step = ck, step_fn(ck.cfg, kernel)
        self.cache, self.table = new_cache(ck.cfg, 1, max_len, cache_dtype)
        self.length = 0

    def feed(self, token_ids) -> np.ndarray:
        """Appends ids [t]; returns their logits [t, vocab]."""
        ids = np.asarray(token_ids, np.int32)[None]
        positions = self.length + np.arange(ids.shape[1], dtype=np.int32)[None]
        logits, self.cache, _ = self.step(self.ck.params, self.cache, self.table, ids, positions,
                                          np.ones_like(ids, bool), self.ck.engram, self.ck.experts)
        self.length += ids.shape[1]
        return np.asarray(logits[0])


def greedy(ck: V41Checkpoint, prompt, new_tokens: int, kernel: str = "auto",
           max_len: int | None = None) -> list[int]:
    """Prefill the prompt, then decode one token at a time, always taking the top logit."""
    seq = Sequence(ck, max_len or len(prompt) + new_tokens, kernel)
    out = [int(np.argmax(seq.feed(prompt)[-1]))]
    while len(out) < new_tokens:
        out.append(int(np.argmax(seq.feed([out[-1]])[-1])))
    return out
