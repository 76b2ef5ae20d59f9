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

The engine runs it through `Speculator` (runtime/steps.py: `Steps.verify`, which carries a
prompt chunk too and drafts after it), each lane's drafts kept in the DecodeState (`Drafts`),
the MTP layer's params a constant input beside the main model's; its routed experts are
residency's, in the one expert state the main model's layers route by (layers/mtp.py), so its
picks are counted and its misses served as theirs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tidejax.runtime.sampling import LaneSampling, probabilities, process, with_logprobs


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


def accept(p, q, drafts, keys, live=None) -> Verdict:
    """p [b, k + 1, v]: the target's distributions at the verify step's positions; q [b, k, v]:
    the draft's, which drafts [b, k] int32 were drawn from; keys [b]: each lane's random key for
    this step (sampling.lane_keys); live [b, k] bool (None: all): the drafts to judge. A draft
    not live is rejected with q taken as 0 there, so the step's token is then drawn from p
    itself (a lane without current drafts) -> Verdict."""
    b, k = drafts.shape
    if live is not None:
        q = jnp.where(live[..., None], q, 0.0)
    split = jax.vmap(jax.random.split)(keys)  # [b, 2]
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(split[:, 0])  # [b, k]
    p_x = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]  # [b, k]
    q_x = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    keep = u * q_x < p_x  # u < p(x) / q(x), without dividing by a q(x) of 0
    if live is not None:
        keep &= live
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Drafts:
    """Each lane's drafts for its next verify step, in the DecodeState: tokens [lanes, k] int32
    and the distributions q [lanes, k, vocab] float32 they were drawn from. Which lanes' are
    current is the scheduler's to know (a lane resumed or just admitted has none)."""

    tokens: jax.Array
    q: jax.Array

    @staticmethod
    def create(lanes: int, k: int, vocab: int) -> "Drafts":
        return Drafts(np.zeros((lanes, k), np.int32), np.zeros((lanes, k, vocab), np.float32))

    def put(self, where, tokens, q) -> "Drafts":
        """These with rows where [lanes] bool from tokens [lanes, k] and q [lanes, k, v]."""
        return Drafts(jnp.where(where[:, None], tokens, self.tokens),
                      jnp.where(where[:, None, None], q, self.q))


@dataclasses.dataclass(frozen=True)
class Speculator:
    """A verify round over rows (lanes) of one sequence each, given the main model (a Decoder,
    which sows its head's hidden state) and the MTP draft module (layers/mtp.py), both over one
    paged pool with the MTP slots.

    verify runs k + 1 positions a row, [latest token, d_1 .. d_k] at n .. n + k; the rows' KV
    past what is kept needs no undoing: the next round starts at the first position not kept
    and rewrites every position it reads before reading it (attention reads positions <= its
    own). Then the MTP layer drafts again from the main model's hidden state at the last kept
    position, the MTP pass masked past it. With one MTP layer and k > 1 the layer is chained on
    its own output hidden state, as DeepSeek's k > 1 drafting with one layer does; the chain
    writes MTP keys at up to n + 2k - 1, so a row's pages must cover that.
    Each position's p, and each draft's q, is drawn by the lane's sampling (LaneSampling) with
    the tokens before it counted, as one token a step would count them (its input first); the
    sampling state a round returns counts the kept tokens alone.
    """

    main: Any
    mtp: Any
    k: int

    def draft(self, mtp_params, hidden, next_tokens, positions, mask, at, cache, table, experts,
              sampling: LaneSampling, keys, replay=None):
        """hidden [b, t, d]: the main model's at positions [b, t]; next_tokens [b, t]: the token
        at each position + 1; mask [b, t]: the positions whose MTP keys are written; at [b]:
        the last kept position's index; sampling: the lanes' with every token up to that
        position counted; replay: a routing replay of the b rows (steps.Replay; None: the
        layer's router chooses) -> (drafts [b, k] int32, q [b, k, v], cache, experts)."""
        b = hidden.shape[0]
        rows = jnp.arange(b)

        def routes(at_positions):  # the MTP layer's replayed picks, or no argument
            return {} if replay is None else {"replay": replay.mtp_ids(at_positions)}
        logits, x, cache, experts = self.mtp.apply(
            {"params": mtp_params}, hidden, next_tokens, positions, mask, cache, table, experts,
            logits_at=at, **routes(positions))
        x, position, live = x[rows, at][:, None], positions[rows, at][:, None], mask[:, :1]
        sampling = sampling.generated(next_tokens[rows, at], live[:, 0])
        drafts, qs = [], []
        for j in range(self.k):
            q = distribution(logits[:, 0], sampling)
            token = draw(q, jax.vmap(jax.random.fold_in, (0, None))(keys, j))
            drafts.append(token)
            qs.append(q)
            if j + 1 < self.k:  # the chain: its own hidden state, the draft as the next token
                sampling = sampling.generated(token, live[:, 0])
                position = position + 1
                logits, x, cache, experts = self.mtp.apply(
                    {"params": mtp_params}, x, token[:, None], position, live, cache, table,
                    experts, **routes(position))
        return jnp.stack(drafts, 1), jnp.stack(qs, 1), cache, experts

    def verify(self, params, mtp_params, tokens, positions, mask, q, cache, table, experts,
               sampling: LaneSampling, keys, replay=None):
        """tokens, positions, mask [b, k + 1]: each row's latest token and its k drafts (drawn
        from q [b, k, v]; a draft masked out is not judged: `accept`'s live); sampling: the
        lanes' before the latest token is counted; keys [b]; replay as draft's, the main model's
        picks at each position its Replay.ids -> (Verdict, Sampled [b, k + 1]:
        the verdict's tokens with their log-probabilities where a lane asked for them, next
        drafts [b, k], their q, cache, experts (the main model's and the MTP layer's picks
        counted), sampling with the kept tokens counted)."""
        routes = {} if replay is None else {"replay": replay.ids(positions)}
        (logits, cache, experts), seen = self.main.apply(
            {"params": params}, tokens, positions, mask, cache, table, experts, **routes,
            mutable=["intermediates"])
        hidden = seen["intermediates"]["head_hidden"][0]
        states, p, processed = [], [], []
        for i in range(self.k + 1):  # position i's p counts the tokens up to its input
            sampling = sampling.generated(tokens[:, i], mask[:, i])
            states.append(sampling)
            processed.append(process(logits[:, i], sampling))
            p.append(probabilities(processed[-1], sampling.params))
        verdict = accept(jnp.stack(p, 1), q, tokens[:, 1:],
                         jax.vmap(jax.random.fold_in, (0, None))(keys, self.k), live=mask[:, 1:])
        b = tokens.shape[0]
        rows = jnp.arange(b)
        sampled = with_logprobs(jnp.stack(processed, 1).reshape(b * (self.k + 1), -1),
                                verdict.tokens.reshape(-1), jnp.any(sampling.params.logprobs))
        sampled = jax.tree.map(lambda a: a.reshape(b, self.k + 1, *a.shape[1:]), sampled)
        sampling = jax.tree.map(lambda *s: jnp.stack(s)[verdict.accepted, rows], *states)
        kept = mask[:, :1] & (jnp.arange(self.k + 1)[None] <= verdict.accepted[:, None])
        drafts, q, cache, experts = self.draft(
            mtp_params, hidden, verdict.tokens, positions, kept, verdict.accepted, cache, table,
            experts, sampling, keys, replay)
        return verdict, sampled, drafts, q, cache, experts, sampling


def distribution(logits, sampling: LaneSampling):
    """What each lane draws from at one position, logits [b, v] -> [b, v] (module docstring)."""
    return probabilities(process(logits, sampling), sampling.params)
