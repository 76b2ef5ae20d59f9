"""Sampling: per-lane parameters as arrays, so one compiled step serves every mix of requests.

A lane's random key is derived from its request's seed and the token's position, so a request
samples the same tokens whether it runs alone or beside others.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LaneSampling:
    """Per-lane sampling arrays: temperature, top_p [b] float32; top_k, seed [b] int32."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    seed: jax.Array

    @staticmethod
    def of(params: list[SamplingParams]) -> "LaneSampling":
        return LaneSampling(
            temperature=np.array([p.temperature for p in params], np.float32),
            top_p=np.array([p.top_p for p in params], np.float32),
            top_k=np.array([min(p.top_k, 1 << 30) for p in params], np.int32),
            seed=np.array([(p.seed if p.seed is not None else 0) & 0x7FFFFFFF for p in params],
                          np.int32))


def sample(logits, lanes: LaneSampling, positions):
    """logits [b, v] float32, positions [b] int32 (of the token being sampled) -> tokens [b] int32.

    All-greedy steps skip the sort over the vocabulary."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.lax.cond(jnp.any(lanes.temperature > 0),
                        lambda: _sample(logits, lanes, positions, greedy), lambda: greedy)


def _sample(logits, lanes: LaneSampling, positions, greedy):
    order = jnp.argsort(-logits, axis=-1)  # [b, v] best first
    ranked = jnp.take_along_axis(logits, order, axis=-1)
    scaled = ranked / jnp.maximum(lanes.temperature, 1e-6)[:, None]
    rank = jnp.arange(logits.shape[-1])[None, :]
    keep = (lanes.top_k[:, None] <= 0) | (rank < lanes.top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of better tokens
    keep &= (before < lanes.top_p[:, None]) | (rank == 0)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(lanes.seed, positions)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, scaled, -jnp.inf))
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(lanes.temperature > 0, sampled, greedy)
