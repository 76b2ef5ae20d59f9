"""The decoder stack the DeepSeek-V3-shaped families share (DeepSeek-V3 with MLA, GLM-4.5 and
Qwen3-MoE with GQA, GLM-5 with DSA): embed; per layer RMSNorm, attention over the paged pool, residual,
RMSNorm, a dense SwiGLU (the first layers) or the MoE layer, residual; final RMSNorm; lm_head
(or the tied embedding).
Also its declared params and the Hugging Face names of every tensor but attention's.

The family gives the attention: a factory `attention(name, layer) -> module` whose call is
(x, positions, cos, sin, *layer_pages, slots, block_table) -> (out, *layer_pages), where
layer_pages are its layer's leaves of the pool (one per field of the pool's dataclass, each
field a tuple over layers). With `carries`, the call also takes the previous layer's carry
after block_table (None before the first layer) and returns its own after the pages: GLM-5's
DSA top-k selection, which its "shared" layers reuse. The config is read by field name:
vocab_size, hidden_size, num_layers, intermediate_size, moe_layers, shared_intermediate_size,
n_routed_experts, moe_intermediate_size, rms_norm_eps, rope, tie_word_embeddings,
num_mtp_layers.

`Decoder.__call__(tokens, positions, token_mask, cache, block_table, experts)` is the one
forward used for prefill chunks, decode steps and full-sequence scoring: each layer writes the
chunk's keys into the row's pages at their positions first, then every query attends to its
row's positions <= its own. The pool may hold layer slots past num_layers (the MTP layers',
layers/mtp.py): the forward passes them through untouched. With apply(..., mutable=
["intermediates"]) it also returns the hidden state the head reads, [b, t, d] after the final
norm, as {"intermediates": {"head_hidden": (x,)}} (what the MTP layers take).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from tidejax.checkpoint import Experts, Rule, Table
from tidejax.kv import paged
from tidejax.kv.paged import PagedCache
from tidejax.models.base import ParamSpec, declare, serving
from tidejax.models.layers.linear import embedding_specs, linear_specs, lm_logits
from tidejax.models.layers.mlp import SwiGLU, swiglu_specs
from tidejax.models.layers.moe import MoE, RouterSpec, moe_specs, routed_expert_specs
from tidejax.models.layers.norm import RMSNorm, norm_specs
from tidejax.models.layers.rope import rope_cos_sin, rope_frequencies
from tidejax.models.loading import load_by_table, open_checkpoint
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import ExpertState


class DecoderLayer(nn.Module):
    cfg: Any
    layer: int
    router: RouterSpec
    attention: Callable[[str, int], nn.Module]
    serve: ServeOptions
    dtype: jnp.dtype
    carries: bool = False

    @nn.compact
    def __call__(self, x, positions, token_mask, cos, sin, pages: tuple, slots, block_table,
                 experts, replay=None, carry=None):
        cfg = self.cfg
        moe_index = cfg.moe_layers.index(self.layer) if self.layer in cfg.moe_layers else None
        return decoder_block(self, moe_index, x, positions, token_mask, cos, sin, pages, slots,
                             block_table, experts, replay, carry)


def decoder_block(module: nn.Module, moe_index: int | None, x, positions, token_mask, cos, sin,
                  pages: tuple, slots, block_table, experts, replay=None, carry=None):
    """A decoder layer's body, its params made in the scope of `module` (which has DecoderLayer's
    fields): attention, residual, then the MoE layer routing by row `moe_index` of `experts`
    (None: the dense SwiGLU), residual -> (x, pages, experts, carry). DecoderLayer's, and an MTP
    layer's block (layers/mtp.py), whose glue shares its scope."""
    cfg, dt = module.cfg, module.dtype
    attn, *pages = module.attention("attn", module.layer)(
        RMSNorm(cfg.rms_norm_eps, dt, name="input_norm")(x), positions, cos, sin, *pages,
        slots, block_table, *((carry,) if module.carries else ()))
    if module.carries:
        *pages, carry = pages
    x = x + attn
    h = RMSNorm(cfg.rms_norm_eps, dt, name="post_attn_norm")(x)
    if moe_index is not None:
        y, experts = MoE(module.router, moe_index, cfg.shared_intermediate_size, module.serve, dt,
                         name="moe")(h, token_mask, experts, replay=replay)
    else:
        y = SwiGLU(cfg.intermediate_size, dt, name="mlp")(h)
    return x + y, tuple(pages), experts, carry


class Decoder(nn.Module):
    cfg: Any
    router: RouterSpec
    attention: Callable[[str, int], nn.Module]
    serve: ServeOptions
    dtype: jnp.dtype = jnp.float32
    carries: bool = False  # the attention threads a carry from layer to layer (module docstring)

    @nn.compact
    @serving
    def __call__(self, tokens, positions, token_mask, cache: PagedCache, block_table,
                 experts: ExpertState, replay=None, logits_at=None):
        """tokens, positions [b, t] int32; token_mask [b, t] bool (False = padding); cache: the
        pool (the family's dataclass of per-layer tuples; nothing per lane); block_table [b, P]
        int32: each row's pages in the pool; replay [b, t, L_moe, k]: recorded picks to route by
        (None: the routers choose); logits_at [b]: the one position of each row to compute logits
        at (None: all) -> logits [b, t or 1, vocab] float32, cache, experts."""
        cfg, dt = self.cfg, self.dtype
        embedding = declare(self, embedding_specs(cfg.vocab_size, cfg.hidden_size, dt,
                                                  cfg.tie_word_embeddings))
        x = jnp.take(embedding["embed"], tokens, axis=0)
        inv_freq, attention_factor = rope_frequencies(cfg.rope)
        cos, sin = rope_cos_sin(positions, inv_freq, attention_factor)
        fields = [f.name for f in dataclasses.fields(cache.pages)]
        layers = list(zip(*(getattr(cache.pages, name) for name in fields)))  # [L] of leaf tuples
        n_pages, page_size = layers[0][0].shape[:2]
        slots = paged.token_slots(block_table, positions, token_mask, n_pages, page_size)
        carry = None
        for i in range(cfg.num_layers):
            x, layers[i], experts, carry = DecoderLayer(
                cfg, i, self.router, self.attention, self.serve, dt, self.carries,
                name=f"layers_{i}")(x, positions, token_mask, cos, sin, layers[i], slots,
                                    block_table, experts, replay, carry)
        x = RMSNorm(cfg.rms_norm_eps, dt, name="norm")(x)
        # the hidden state the head reads (after the final norm), for the MTP layers (mtp.py):
        # apply(..., mutable=["intermediates"]) returns it; the outputs are unchanged
        self.sow("intermediates", "head_hidden", x)
        head = embedding["embed" if cfg.tie_word_embeddings else "lm_head"]
        logits = lm_logits(x, head, logits_at)
        pages = cache.pages.replace(**{name: tuple(layer[j] for layer in layers)
                                       for j, name in enumerate(fields)})
        return logits, PagedCache(pages), experts


def decoder_specs(cfg, router: RouterSpec, attention_specs: Callable[[int], dict], dtype) -> dict:
    """The Decoder's declared params (everything but the routed experts), with
    `attention_specs(layer)` the params of that layer's attention."""
    d = cfg.hidden_size
    specs = {**embedding_specs(cfg.vocab_size, d, dtype, cfg.tie_word_embeddings),
             "norm": norm_specs(d, "embed", dtype)}
    for i in range(cfg.num_layers):
        layer = {"input_norm": norm_specs(d, "embed", dtype), "attn": attention_specs(i),
                 "post_attn_norm": norm_specs(d, "embed", dtype)}
        if i in cfg.moe_layers:
            layer["moe"] = moe_specs(router, d, cfg.shared_intermediate_size, dtype)
        else:
            layer["mlp"] = swiglu_specs(d, cfg.intermediate_size, dtype)
        specs[f"layers_{i}"] = layer
    return specs


def expert_dims(cfg) -> tuple[int, int, int, int]:
    """(MoE layers, experts per layer, hidden, expert intermediate)."""
    return len(cfg.moe_layers), cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size


def decoder_expert_specs(cfg, dtype, bias: bool = False) -> dict:
    """The routed experts as host-pool rows (moe layer * n_routed_experts + expert), with their
    biases where `bias` (gpt-oss)."""
    n_moe, n_experts, hidden, inter = expert_dims(cfg)
    return routed_expert_specs(n_moe * n_experts, hidden, inter, dtype, bias)


LAYER = "model.layers.{i}"  # a decoder layer's Hugging Face prefix (field i)
ROTARY_CACHES = ("{prefix:.*}rotary_emb.inv_freq",)  # what some exports include, read past


def stack_rules() -> tuple:
    """The rules of the embedding, the head, the final norm and each layer's two norms."""
    return (
        Rule("model.embed_tokens.weight", "embed"),
        Rule("model.norm.weight", "norm.weight"),
        Rule("lm_head.weight", "lm_head"),
        Rule(f"{LAYER}.input_layernorm.weight", "layers_{i}.input_norm.weight"),
        Rule(f"{LAYER}.post_attention_layernorm.weight", "layers_{i}.post_attn_norm.weight"),
    )


def decoder_rules(cfg) -> tuple:
    """The rules of every tensor but attention's (an MTP layer's too, into the paths
    `layers_{i}` with i its checkpoint index, where the family declares them)."""
    mtp = "|".join(str(cfg.num_layers + j) for j in range(cfg.num_mtp_layers))
    # the routed experts of the decoder layers, not of the MTP layers after them
    layer = r"model\.layers\." + (f"(?!(?:{mtp})\\.)" if mtp else "") + r"[0-9]+\.mlp"
    experts = "{layer:" + layer + "}.experts"
    return stack_rules() + (
        Rule(f"{LAYER}.mlp.{{proj:gate|up|down}}_proj.weight", "layers_{i}.mlp.{proj}_proj.weight"),
        Rule(f"{LAYER}.mlp.gate.weight", "layers_{i}.moe.gate_weight"),
        Rule(f"{LAYER}.mlp.gate.e_score_correction_bias", "layers_{i}.moe.gate_bias"),
        Rule(f"{LAYER}.mlp.shared_experts.{{proj:gate|up|down}}_proj.weight",
             "layers_{i}.moe.shared.{proj}_proj.weight"),
        # routed experts: published per-expert tensors (FP8 pairs allowed), transformers 5's fused
        # [E, ...] tensors, or fused MXFP4 blocks and scales (the reader pairs those into one
        # tensor)
        Experts(experts + ".{expert}.{part:gate|up|down}_proj.weight"),
        Experts(experts + ".{part:gate_up|down}_proj"),
    )


def decoder_table(cfg, attention_rules: tuple, mtp_rules: tuple | None = None) -> Table:
    """Hugging Face tensor names -> the declared params and the routed-expert rows, with the
    family's `attention_rules`. The multi-token-prediction layers after the last decoder layer
    are ignored where `mtp_rules` is None; otherwise the decoder's and attention's rules fill
    their declared paths `layers_{i}` too, and `mtp_rules` the rest of them (their own glue and
    routed experts), and their copies of the main model's embedding and head
    (`embed_tokens`, `shared_head.head`: published DeepSeek-V3 and GLM checkpoints carry them)
    are read past: the MTP layers draft through the main model's own, as transformers' MtpModel
    ties them. Also ignored: the rotary caches some exports include."""
    if mtp_rules is None:
        mtp = tuple(f"model.layers.{i}.{{rest:.*}}" for i in mtp_layers(cfg))
    else:
        mtp = tuple(f"model.layers.{i}.{{copy:embed_tokens|shared_head\\.head}}.weight"
                    for i in mtp_layers(cfg))
    return Table(decoder_rules(cfg) + attention_rules + (mtp_rules or ()),
                 ignore=mtp + ROTARY_CACHES,
                 expert_layers=[f"model.layers.{i}.mlp" for i in cfg.moe_layers])


def block_sparse_moe_table(cfg, attention_rules: tuple) -> Table:
    """Hugging Face tensor names -> the declared params and the routed-expert rows of the
    families published with Mixtral's names (Mixtral, MiniMax-M2): the stack's, the family's
    `attention_rules`, and each layer's `block_sparse_moe`: the router `gate`, the correction
    bias where the family has one, per-expert w1 = gate, w3 = up, w2 = down."""
    moe = f"{LAYER}.block_sparse_moe"
    experts = r"{layer:model\.layers\.[0-9]+\.block_sparse_moe}.experts.{expert}"
    return Table(stack_rules() + attention_rules + (
        Rule(f"{moe}.gate.weight", "layers_{i}.moe.gate_weight"),
        Rule(f"{moe}.e_score_correction_bias", "layers_{i}.moe.gate_bias"),
        Experts(experts + ".w1.weight", part="gate"),
        Experts(experts + ".w3.weight", part="up"),
        Experts(experts + ".w2.weight", part="down"),
    ), ignore=ROTARY_CACHES,
        expert_layers=[f"model.layers.{i}.block_sparse_moe" for i in cfg.moe_layers])


def mtp_layers(cfg) -> tuple[int, ...]:
    """The checkpoint indices of the MTP (NextN) layers, after the last decoder layer."""
    return tuple(range(cfg.num_layers, cfg.num_layers + cfg.num_mtp_layers))


def mtp_specs(cfg, router: RouterSpec, attention: dict, dtype) -> dict:
    """The MTP layers as published (DeepSeek-V3's and GLM's NextN layers alike), kept on the host
    as stored for speculative decoding (their draft forward: mtp.py):
    {"layers_{i}": a MoE decoder layer with `attention` its attention's params and its own
    routed experts by id, and the MTP glue (enorm, hnorm, eh_proj [d, 2d], shared_head_norm)};
    the embedding and head are the main model's."""
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    experts = {str(e): {"gate_proj": ParamSpec((f, d), dtype, ("ffw", "embed")),
                        "up_proj": ParamSpec((f, d), dtype, ("ffw", "embed")),
                        "down_proj": ParamSpec((d, f), dtype, ("embed", "ffw"))}
               for e in range(cfg.n_routed_experts)}
    layer = {"input_norm": norm_specs(d, "embed", dtype), "attn": attention,
             "post_attn_norm": norm_specs(d, "embed", dtype),
             "moe": moe_specs(router, d, cfg.shared_intermediate_size, dtype)
             | {"experts": experts},
             "enorm": norm_specs(d, "embed", dtype), "hnorm": norm_specs(d, "embed", dtype),
             "eh_proj": linear_specs(d, 2 * d, ("embed", None), dtype),
             "shared_head_norm": norm_specs(d, "embed", dtype)}
    return {f"layers_{i}": layer for i in mtp_layers(cfg)}


def mtp_rules(cfg) -> tuple:
    """The MTP layers' own tensors (the decoder's and attention's rules fill the rest of them)."""
    mtp = "model.layers.{i:" + "|".join(map(str, mtp_layers(cfg))) + "}"
    return (
        Rule(mtp + ".{norm:enorm|hnorm}.weight", "layers_{i}.{norm}.weight"),
        Rule(mtp + ".eh_proj.weight", "layers_{i}.eh_proj.weight"),
        Rule(mtp + ".shared_head.norm.weight", "layers_{i}.shared_head_norm.weight"),
        Rule(mtp + ".mlp.experts.{expert}.{proj:gate|up|down}_proj.weight",
             "layers_{i}.moe.experts.{expert}.{proj}_proj"),
    )


def load_with_mtp(cfg, model_dir, raw_config: dict, checkpoint_table: Callable, params: dict,
                  experts: dict, mtp: dict, put_row) -> tuple[dict, dict | None]:
    """The family's load_by_table with its MTP layers (`mtp`: their mtp_specs) kept on the host
    as stored where the checkpoint holds them, read past where it does not (some exports drop
    them and keep config.json's count, and GLM-4.5's count is 1 where the field is absent, as in
    transformers): `checkpoint_table(cfg, mtp)` the family's table with or without them ->
    (dense params, the aux: {"layers_{i}": an MTP layer's tensors}, or None without them)."""
    # one reader (the headers read once) for the table with or without the MTP layers:
    # decoder_table declares no FP8 scale blocks of its own, so theirs are alike
    reader = open_checkpoint(model_dir, raw_config, checkpoint_table(cfg, bool(mtp)))
    first = f"model.layers.{cfg.num_layers}."
    stored = mtp and any(name.startswith(first) for name in reader.names())
    kept = mtp if stored else {}
    loaded = load_by_table(model_dir, raw_config, checkpoint_table(cfg, bool(kept)), params,
                           experts, put_row, host_specs=kept, reader=reader)
    return loaded, {name: loaded.pop(name) for name in kept} or None
