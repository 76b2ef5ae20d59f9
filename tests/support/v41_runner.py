"""A plain DeepSeek-V4.1 runner for the golden tests, every expert resident: the jitted step
and a full forward for scoring (the engine serves the family through
tidejax.models.deepseek_v41.family).
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
