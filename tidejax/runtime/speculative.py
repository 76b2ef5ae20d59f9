"""Speculative decoding's acceptance rule (issue 33): which of a lane's k drafted tokens a verify
step keeps, and the token it adds after them.

A verify step runs k + 1 positions a lane: its latest token, then the k drafts. The target's
distribution at position i (i < k) judges draft i; the one at k gives the token after the last
draft. The rule is the rejection sampling of Leviathan et al. and Chen et al. (2023), which
draws exactly from the target distribution p whatever the draft's q: draft x_i is kept with
probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the step's last token is drawn
from norm(max(0, p_i - q_i)) and the later drafts are dropped; with all k kept it is drawn from
p_k. p and q are `sampling.probabilities` of the logits after `sampling.process`, so every
sampling parameter applies to both. A greedy lane's p and q are one-hot, and the rule becomes
greedy acceptance: the longest prefix of drafts equal to the target's argmax, then the target's
own next token, so its output equals one-token-a-step decoding token for token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Verdict:
    """A verify step's outcome per lane: accepted [b] int32, the drafts kept (0..k); tokens
    [b, k + 1] int32, the kept drafts then the step's own token at index `accepted` (0 after)."""

    accepted: jax.Array
    tokens: jax.Array


def draw(probs, keys):
    """One token a row of probs [b, v] (rows summing to 1) with keys [b] -> [b] int32."""
    logp = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), -jnp.inf)
    return jax.vmap(jax.random.categorical)(keys, logp).astype(jnp.int32)


def accept(p, q, drafts, keys) -> Verdict:
    """p [b, k + 1, v]: the target's distributions at the verify step's positions; q [b, k, v]:
    the draft's, which drafts [b, k] int32 were drawn from; keys [b]: each lane's random key for
    this step (sampling.lane_keys) -> Verdict."""
    b, k = drafts.shape
    split = jax.vmap(jax.random.split)(keys)  # [b, 2]
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(split[:, 0])  # [b, k]
    p_x = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]  # [b, k]
    q_x = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    keep = u * q_x < p_x  # u < p(x) / q(x), without dividing by a q(x) of 0
    accepted = jnp.sum(jnp.cumprod(keep, axis=1), axis=1).astype(jnp.int32)  # [b]
    # [b, k + 1, v]: where the step's token comes from after each possible number kept
    residual = jnp.concatenate([jnp.maximum(p[:, :k] - q, 0.0), p[:, k:]], axis=1)
    last = residual[jnp.arange(b), accepted]  # [b, v]
    mass = last.sum(axis=-1, keepdims=True)
    # a rejection where p <= q everywhere has probability 0; rounding can still leave no mass
    last = jnp.where(mass > 0, last / jnp.where(mass > 0, mass, 1.0), p[jnp.arange(b), accepted])
    final = draw(last, split[:, 1])
    index = jnp.arange(k + 1)[None, :]
    padded = jnp.pad(drafts, ((0, 0), (0, 1)))
    tokens = jnp.where(index < accepted[:, None], padded,
                       jnp.where(index == accepted[:, None], final[:, None], 0))
    return Verdict(accepted, tokens.astype(jnp.int32))
