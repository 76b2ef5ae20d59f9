"""Sampling: per-lane parameters as arrays, so one compiled step serves every mix of requests.

One `SamplingParams` per request goes from the HTTP edge (or `Engine.generate`) to its lane's
row of `LaneParams`, written into the DecodeState when the request takes a lane. The lane's
token counts (`LaneSampling.counts`, `seen`) live beside them in the donated state and are
updated inside the step, so the penalties cost no host work and no recompiles.

The logits of a lane go through, in order:
1. the repetition penalty (transformers' semantics) over the tokens seen, prompt and generated:
   a seen token's logit is divided by it where positive, multiplied by it where negative;
2. the frequency and presence penalties (OpenAI's) over the generated tokens:
   logit -= frequency * count + presence * (count > 0);
3. logit_bias, added;
4. the thinking budget: once a request has generated `thinking_budget` tokens and none of them
   was `thinking_end`, its next token is `thinking_end`.
The log-probabilities reported (`logprobs`) are the log-softmax of these processed logits,
before temperature and truncation. Then greedy lanes take the argmax; sampling lanes divide by
the temperature and keep the top_k best, then those within top_p of mass and those at least
min_p times as likely as the best (both over the top_k's renormalized distribution), and draw.
A lane's random key is derived from its request's seed and the token's position, so a request
samples the same tokens whether it runs alone or beside others.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from tidejax.errors import RequestError

MAX_LOGIT_BIAS = 300  # logit_bias entries a request may give (OpenAI's limit)
TOP_LOGPROBS = 20  # the most alternatives a request may ask for at each token (OpenAI's limit)
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties (OpenAI's range)
BIAS_RANGE = (-100.0, 100.0)  # a logit_bias value (OpenAI's range)
LOGPROB_FLOOR = -9999.0  # for a token that cannot be drawn (OpenAI's figure; JSON has no -inf)


class SamplingError(RequestError):
    """A sampling parameter out of range; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"'{field}' {message}", field)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a dict is taken too
    logprobs: int | None = None  # None: none; k: the token's and the k most likely alternatives
    thinking_budget: int = 0  # 0 = none; else tokens before `thinking_end` is forced
    thinking_end: int = -1  # the token that closes the reasoning (with a budget)

    def __post_init__(self):
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        _check("temperature", self.temperature, 0.0, math.inf)
        if not 0 < self.top_p <= 1:
            raise SamplingError("top_p", f"= {self.top_p} is out of range (0, 1]")
        if self.top_k < 0:
            raise SamplingError("top_k", f"= {self.top_k} should be 0 (off) or positive")
        _check("min_p", self.min_p, 0.0, 1.0)
        _check("presence_penalty", self.presence_penalty, *PENALTY_RANGE)
        _check("frequency_penalty", self.frequency_penalty, *PENALTY_RANGE)
        _check("repetition_penalty", self.repetition_penalty, 0.0, math.inf)
        if self.repetition_penalty == 0:
            raise SamplingError("repetition_penalty", "should be above 0")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingError("logit_bias", f"has {len(self.logit_bias)} entries; at most "
                                              f"{MAX_LOGIT_BIAS}")
        ids = [token for token, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(token < 0 for token in ids):
            raise SamplingError("logit_bias", "should name each token id (>= 0) once")
        for token, bias in self.logit_bias:
            _check(f"logit_bias.{token}", bias, *BIAS_RANGE)
        if self.logprobs is not None and not 0 <= self.logprobs <= TOP_LOGPROBS:
            raise SamplingError("logprobs", f"= {self.logprobs} is out of range [0, "
                                            f"{TOP_LOGPROBS}]")
        if self.thinking_budget < 0 or (self.thinking_budget and self.thinking_end < 0):
            raise SamplingError("thinking_budget", "should be 0 (none), or positive with the "
                                                   "token that ends the reasoning")

    def check_vocab(self, vocab: int) -> None:
        """Every token id it names is below `vocab`."""
        for token, _ in self.logit_bias:
            if token >= vocab:
                raise SamplingError("logit_bias", f"has token id {token}, outside the "
                                                  f"vocabulary [0, {vocab})")
        if self.thinking_end >= vocab:
            raise SamplingError("thinking_end", f"= {self.thinking_end} is outside the "
                                                f"vocabulary [0, {vocab})")


def _check(field: str, value: float, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise SamplingError(field, f"= {value} is out of range [{low}, {high}]")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LaneParams:
    """Each lane's sampling parameters: temperature, top_p, min_p, presence, frequency,
    repetition [b] float32; top_k, seed, thinking_budget, thinking_end [b] int32; logprobs [b]
    bool; bias_ids [b, MAX_LOGIT_BIAS] int32 and bias [b, MAX_LOGIT_BIAS] float32 (padding: id 0,
    bias 0)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    seed: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    bias_ids: jax.Array
    bias: jax.Array
    logprobs: jax.Array
    thinking_budget: jax.Array
    thinking_end: jax.Array

    @staticmethod
    def of(params: list[SamplingParams]) -> "LaneParams":
        bias_ids = np.zeros((len(params), MAX_LOGIT_BIAS), np.int32)
        bias = np.zeros((len(params), MAX_LOGIT_BIAS), np.float32)
        for row, p in enumerate(params):
            for i, (token, value) in enumerate(p.logit_bias):
                bias_ids[row, i], bias[row, i] = token, value

        def column(name, dtype):
            return np.array([getattr(p, name) for p in params], dtype)

        return LaneParams(
            temperature=column("temperature", np.float32), top_p=column("top_p", np.float32),
            top_k=np.array([min(p.top_k, 1 << 30) for p in params], np.int32),
            min_p=column("min_p", np.float32),
            seed=np.array([(p.seed if p.seed is not None else 0) & 0x7FFFFFFF for p in params],
                          np.int32),
            presence=column("presence_penalty", np.float32),
            frequency=column("frequency_penalty", np.float32),
            repetition=column("repetition_penalty", np.float32), bias_ids=bias_ids, bias=bias,
            logprobs=np.array([p.logprobs is not None for p in params]),
            thinking_budget=np.array([min(p.thinking_budget, 1 << 30) for p in params], np.int32),
            thinking_end=np.array([max(p.thinking_end, 0) for p in params], np.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LaneSampling:
    """The DecodeState's sampling part: each lane's parameters (set when a request takes the
    lane) and its request's tokens so far, updated in the step: counts [lanes, vocab] int32 (the
    generated tokens), seen [lanes, vocab] bool (the prompt's and the generated ones)."""

    params: LaneParams
    counts: jax.Array
    seen: jax.Array

    @staticmethod
    def create(lanes: int, vocab: int) -> "LaneSampling":
        """Every lane greedy, no tokens seen (host arrays)."""
        return LaneSampling(LaneParams.of([SamplingParams()] * lanes),
                            np.zeros((lanes, vocab), np.int32), np.zeros((lanes, vocab), bool))

    def lane(self, lane) -> "LaneSampling":
        """One lane's rows, [1, ...] each."""
        return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, lane, 1, 0), self)

    def set_lane(self, lane, row: LaneParams, seen) -> "LaneSampling":
        """`row` [1] as lane's parameters, its token counts cleared (a new request) but for
        `seen` [vocab] bool: the prompt tokens of a cached prefix, which no step of it runs."""
        return LaneSampling(jax.tree.map(lambda a, r: a.at[lane].set(r[0]), self.params, row),
                            self.counts.at[lane].set(0), self.seen.at[lane].set(seen))

    def saw_prompt(self, lane, tokens, mask) -> "LaneSampling":
        """The lane's prompt tokens [C] where mask [C] marked seen."""
        vocab = self.seen.shape[1]
        return dataclasses.replace(self, seen=self.seen.at[lane, jnp.where(mask, tokens, vocab)]
                                   .set(True, mode="drop"))

    def generated(self, tokens, active) -> "LaneSampling":
        """Each active lane's generated token [lanes] counted and seen (a decoding lane's input
        token is its latest generated one)."""
        vocab = self.counts.shape[1]
        rows = jnp.arange(tokens.shape[0])
        at = jnp.where(active, tokens, vocab)
        return dataclasses.replace(self, counts=self.counts.at[rows, at].add(1, mode="drop"),
                                   seen=self.seen.at[rows, at].set(True, mode="drop"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Sampled:
    """A step's output per lane: tokens [b] int32; logprob [b] float32 (the token's);
    top_ids [b, K] int32 and top_logprobs [b, K] float32, most likely first (K = TOP_LOGPROBS,
    or the vocabulary where smaller). The log-probabilities are 0 where no lane of the step asked
    for them."""

    tokens: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array

    def at(self, lane, row: "Sampled") -> "Sampled":
        """This with lane's entries from `row` [1]."""
        return jax.tree.map(lambda a, r: a.at[lane].set(r[0]), self, row)


def process(logits, lanes: LaneSampling):
    """The penalties, logit_bias and the thinking budget applied: logits [b, v] float32 ->
    [b, v] float32 (the module docstring gives the order)."""
    p = lanes.params
    rep = p.repetition[:, None]
    logits = jnp.where(lanes.seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    counts = lanes.counts.astype(jnp.float32)
    logits = logits - p.frequency[:, None] * counts - p.presence[:, None] * (counts > 0)
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, p.bias_ids].add(p.bias)
    ended = jnp.take_along_axis(lanes.counts, p.thinking_end[:, None], axis=1)[:, 0] > 0
    force = (p.thinking_budget > 0) & ~ended & (lanes.counts.sum(axis=1) >= p.thinking_budget)
    vocab = jnp.arange(logits.shape[1])[None, :]
    forced = jnp.where(vocab == p.thinking_end[:, None], 0.0, -jnp.inf)
    return jnp.where(force[:, None], forced, logits)


def sample(logits, lanes: LaneSampling, positions) -> Sampled:
    """logits [b, v] float32, positions [b] int32 (of the token being sampled) -> Sampled.

    All-greedy steps skip the sort over the vocabulary; steps where no lane asked for logprobs
    skip their log-softmax and top-k."""
    p = lanes.params
    logits = process(logits, lanes)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tokens = jax.lax.cond(jnp.any(p.temperature > 0),
                          lambda: _sample(logits, p, positions, greedy), lambda: greedy)
    return with_logprobs(logits, tokens, jnp.any(p.logprobs))


def with_logprobs(logits, tokens, wanted) -> Sampled:
    """Processed logits [n, v] float32 and the tokens [n] drawn from them -> Sampled, its
    log-probabilities computed only where `wanted` (a bool scalar), else zeros."""
    k = min(TOP_LOGPROBS, logits.shape[-1])

    def logprobs():
        logp = jnp.maximum(jax.nn.log_softmax(logits, axis=-1), LOGPROB_FLOOR)
        top, ids = jax.lax.top_k(logp, k)
        return (jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0], ids.astype(jnp.int32),
                top)

    def none():
        b = logits.shape[0]
        return (jnp.zeros(b, jnp.float32), jnp.zeros((b, k), jnp.int32),
                jnp.zeros((b, k), jnp.float32))

    return Sampled(tokens, *jax.lax.cond(wanted, logprobs, none))


def probabilities(logits, p: LaneParams):
    """The distribution each lane draws from, processed logits [b, v] float32 -> [b, v] float32
    in vocabulary order: the argmax one-hot for a greedy lane, else the tempered softmax over what
    top_k, top_p and min_p keep (what `sample` draws by; speculative decoding's p and q)."""
    order, kept = _kept(logits, p)
    rows = jnp.arange(logits.shape[0])[:, None]
    probs = jnp.zeros_like(logits).at[rows, order].set(jax.nn.softmax(kept, axis=-1))
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=logits.dtype)
    return jnp.where(p.temperature[:, None] > 0, probs, greedy)


def lane_keys(seed, positions):
    """Each lane's random key for the token at positions [b]: its request's seed [b], folded."""
    return jax.vmap(lambda s, q: jax.random.fold_in(jax.random.key(s), q))(seed, positions)


def _kept(logits, p: LaneParams):
    """(order [b, v] best first, the tempered logits [b, v] in that order, -inf where top_k,
    top_p or min_p drop them)."""
    order = jnp.argsort(-logits, axis=-1)  # [b, v] best first
    ranked = jnp.take_along_axis(logits, order, axis=-1)
    scaled = ranked / jnp.maximum(p.temperature, 1e-6)[:, None]
    rank = jnp.arange(logits.shape[-1])[None, :]
    keep = (p.top_k[:, None] <= 0) | (rank < p.top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of better tokens
    keep &= (before < p.top_p[:, None]) | (rank == 0)
    keep &= probs >= p.min_p[:, None] * probs[:, :1]
    return order, jnp.where(keep, scaled, -jnp.inf)


def _sample(logits, p: LaneParams, positions, greedy):
    order, kept = _kept(logits, p)
    choice = jax.vmap(jax.random.categorical)(lane_keys(p.seed, positions), kept)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(p.temperature > 0, sampled, greedy)
