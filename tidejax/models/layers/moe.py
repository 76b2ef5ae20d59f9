"""DeepSeekMoE: the router and the MoE layer.

The router decides what each token *wants*; the routed experts are served by the residency layer
(`tidejax.residency.serve.serve_routed`), which owns the bank, the rowmap, the demand counters and
the miss policy. This module never sees expert weights, so swapping the bank or the kernel never
touches the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tidejax.errors import ConfigError
from tidejax.fields import Fields
from tidejax.models.base import ParamSpec, declare
from tidejax.models.layers.linear import HIGHEST
from tidejax.models.layers.mlp import SwiGLU, swiglu_specs
from tidejax.residency.serve import ServeOptions, serve_routed
from tidejax.residency.state import ExpertState


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    n_experts: int
    top_k: int
    scoring: str = "sigmoid"  # "sigmoid" | "softmax" | "sqrtsoftplus" (DeepSeek-V4) |
    # "topk_softmax" (gpt-oss: top-k of the logits, softmax over the k picked)
    temperature: float = 1.0  # logits are divided by it before scoring
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"  # "top2_sum" (noaux_tc) | "max" (group_limited_greedy)
    use_bias: bool = True  # e_score_correction_bias, for selection only
    logit_bias: bool = False  # the router Linear's own bias, added to the logits (gpt-oss)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    hash_vocab: int = 0  # > 0: a fixed token -> experts table picks (DeepSeek-V4's hash layers)


def read_groups(f: Fields, n_routed: int) -> tuple[int, int]:
    """(n_group, topk_group) of a config.json (`f`), checked: groups of at least 2 experts
    dividing n_routed, topk_group in 1..n_group; absent or 0 means 1."""
    n_group, topk_group = f.opt("n_group", 1) or 1, f.opt("topk_group", 1) or 1
    if n_routed % n_group or (n_group > 1 and n_routed // n_group < 2):
        raise ConfigError(f"{f.source}: field 'n_group' = {n_group} must divide "
                          f"n_routed_experts = {n_routed} into groups of at least 2")
    if not 1 <= topk_group <= n_group:
        raise ConfigError(f"{f.source}: field 'topk_group' = {topk_group} must be in 1..n_group "
                          f"({n_group})")
    return n_group, topk_group


def read_top_k(f: Fields, n_experts: int, default: int | None = None) -> int:
    """num_experts_per_tok of a config.json (`f`; required where no default), in 1..n_experts."""
    top_k = f.req("num_experts_per_tok") if default is None else f.opt("num_experts_per_tok",
                                                                         default)
    if not 0 < top_k <= n_experts:
        raise ConfigError(f"{f.source}: field 'num_experts_per_tok' = {top_k} must be in "
                          f"1..{n_experts} (the routed experts)")
    return top_k


def noaux_router(cfg) -> RouterSpec:
    """DeepSeek-V3's noaux_tc routing as GLM-4.5 and GLM-5 have it (transformers'
    Glm4MoeTopkRouter, GlmMoeDsaTopkRouter): sigmoid scores; the correction bias shifts the
    choice; groups ranked by the sum of their top-2 biased scores. Reads n_routed_experts,
    num_experts_per_tok, n_group, topk_group, norm_topk_prob, routed_scaling_factor."""
    return RouterSpec(
        n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, scoring="sigmoid",
        n_group=cfg.n_group, topk_group=cfg.topk_group, group_score="top2_sum", use_bias=True,
        norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor)


def moe_specs(router: RouterSpec, hidden: int, shared_intermediate: int, dtype) -> dict:
    """MoE's declared params: the router (float32, as the references keep it), shared experts."""
    e = router.n_experts
    specs = {"gate_weight": ParamSpec((e, hidden), jnp.float32, ("experts", "embed"))}
    if router.use_bias or router.logit_bias:
        specs["gate_bias"] = ParamSpec((e,), jnp.float32, ("experts",), init="zeros")
    if router.hash_vocab:  # token -> experts (DeepSeek-V4's hash layers)
        specs["tid2eid"] = ParamSpec((router.hash_vocab, router.top_k), jnp.int32, ("vocab", None),
                                     init="zeros")
    if shared_intermediate:
        specs["shared"] = swiglu_specs(hidden, shared_intermediate, dtype)
    return specs


def routed_expert_specs(rows: int, hidden: int, intermediate: int, dtype,
                        bias: bool = False) -> dict:
    """The routed experts as host-pool rows (row = moe layer * experts + expert): gate_up
    [rows, 2f, d] (gate rows, then up rows) and down [rows, d, f]; with `bias` gate_up_bias
    [rows, 2f] and down_bias [rows, d] (tidejax.contract)."""
    specs = {"gate_up": ParamSpec((rows, 2 * intermediate, hidden), dtype,
                                  ("experts", "ffw", "embed")),
             "down": ParamSpec((rows, hidden, intermediate), dtype, ("experts", "embed", "ffw"))}
    if bias:
        specs |= {"gate_up_bias": ParamSpec((rows, 2 * intermediate), dtype, ("experts", "ffw"),
                                            init="zeros"),
                  "down_bias": ParamSpec((rows, hidden), dtype, ("experts", "embed"),
                                         init="zeros")}
    return specs


def route(x, weight, bias, spec: RouterSpec, replayed_ids=None):
    """x [T, d] -> wanted picks: ids [T, k] int32, weights [T, k] float32, choice [T, e] float32.

    Scores come from float32 logits; the correction bias shifts only the choice, never the
    weights; group-limited selection keeps the topk_group best groups of experts.
    `replayed_ids` [T, k] (recorded picks, or a hash table's) replace the selection; weights still
    come from the scores.
    """
    logits = jnp.einsum("td,ed->te", x.astype(jnp.float32), weight.astype(jnp.float32),
                        precision=HIGHEST)  # [T, e]
    if spec.logit_bias:  # the router's own bias (gpt-oss), not a correction of the choice
        logits, bias = logits + bias, None
    if spec.temperature != 1.0:
        logits = logits / spec.temperature
    if spec.scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    elif spec.scoring == "sqrtsoftplus":
        scores = jnp.sqrt(jax.nn.softplus(logits))
    elif spec.scoring == "topk_softmax":  # the softmax runs over the picked logits (below)
        scores = logits
    else:
        scores = jax.nn.softmax(logits, -1)
    choice = scores + bias if bias is not None else scores
    if spec.n_group > 1 and spec.topk_group < spec.n_group:
        grouped = choice.reshape(choice.shape[0], spec.n_group, -1)  # [T, groups, e/groups]
        if spec.group_score == "top2_sum":
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        else:
            group_scores = grouped.max(-1)
        _, keep = jax.lax.top_k(group_scores, spec.topk_group)  # [T, topk_group]
        group_mask = jnp.zeros(group_scores.shape, bool).at[
            jnp.arange(group_scores.shape[0])[:, None], keep].set(True)
        expert_mask = jnp.repeat(group_mask, spec.n_experts // spec.n_group, axis=1)
        choice = jnp.where(expert_mask, choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, spec.top_k)  # [T, k]
    if replayed_ids is not None:
        ids = replayed_ids
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if spec.scoring == "topk_softmax":
        weights = jax.nn.softmax(weights, -1)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * spec.routed_scaling_factor
    return ids.astype(jnp.int32), weights, choice


class MoE(nn.Module):
    """Router + routed experts (through residency) + shared experts (a SwiGLU of
    shared_intermediate, clamped as the routed experts are: serve.swiglu_limit).

    With router.hash_vocab the picks come from a fixed table `tid2eid` [hash_vocab, top_k]
    indexed by the token ids (pass `tokens`); the weights still come from the scores.
    `replay` [b, t, L_moe, k] (recorded picks of every MoE layer) makes the layer route by its
    row `moe_index` instead of its own choice: benchmarks on random-weight models replay a trained
    model's routing, so skew and domain shifts are realistic.
    """

    router: RouterSpec
    moe_index: int  # this layer's row in the rowmap / counters
    shared_intermediate: int  # 0 = no shared experts
    serve: ServeOptions
    dtype: jnp.dtype = jnp.float32
    act_dtype: Any = None  # the shared experts' SwiGLU and their sum with the routed output are
    # computed in it (None: the input's dtype); DeepSeek-V4 / V4.1 use float32, as their references

    @nn.compact
    def __call__(self, x, token_mask, experts: ExpertState, tokens=None, replay=None):
        """x [b, t, d], token_mask [b, t], tokens [b, t] (hash routing only), replay
        [b, t, L_moe, k] or None -> (y [b, t, d], experts)."""
        spec = self.router
        b, t, d = x.shape
        p = declare(self, moe_specs(spec, d, self.shared_intermediate, self.dtype))
        gate_w, bias = p["gate_weight"], p.get("gate_bias")  # None: the router has none
        flat = x.reshape(b * t, d)
        picked = None
        if spec.hash_vocab:
            picked = p["tid2eid"][tokens.reshape(-1)]  # [b * t, k]
        if replay is not None:
            picked = replay[:, :, self.moe_index].reshape(b * t, spec.top_k)
        ids, weights, choice = route(flat, gate_w, bias, spec, picked)
        y, experts = serve_routed(self.moe_index, flat, ids, weights, choice,
                                  token_mask.reshape(b * t), experts, self.serve)
        y = y.reshape(b, t, d).astype(x.dtype)
        if self.shared_intermediate:
            shared = SwiGLU(self.shared_intermediate, self.dtype, self.serve.swiglu_limit,
                            self.act_dtype, name="shared")(x)
            acc = self.act_dtype or x.dtype  # routed + shared are summed in it
            y = (y.astype(acc) + shared.astype(acc)).astype(x.dtype)
        return y, experts
