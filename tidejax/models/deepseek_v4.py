"""DeepSeek-V4 (`deepseek_v4`, transformers 5.23+): the earlier architecture of the V4.1 line.

Shares with V4.1 (through tidejax.models.layers): mHC streams with Sinkhorn, latent single-KV attention with a
sliding window, sinks, interleaved tail RoPE and its inverse on the output, grouped low-rank
output, clamped SwiGLU, sqrtsoftplus routing. Its own: per-layer compressors of two kinds, CSA
(rate 4, overlapping windows: entry w pools window w-1's "Ca" half and window w's "Cb" half, with
a learned position bias, and its own indexer with its own compressor) and HCA (rate 128, no
overlap, no indexer: every visible entry attends); an unweighted norm on q per head; hash routing
(a fixed token -> experts table) in the first MoE layers; each mHC site collapses with its own
pre; a final hyper head. No QAT fake quantizers.

`DeepseekV4.__call__(tokens, positions, token_mask, cache, experts)` is the one forward for
prefill chunks and decode steps (chunks contiguous per row, real tokens first); `full_forward`
scores a sequence; `load(model_dir)` reads a transformers-layout folder.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from tidejax.fields import ConfigError, read_json
from tidejax.models.layers.compress import pool_groups, scatter_rows, selection_mask, top_k_select
from tidejax.models.layers.latent_window import (grouped_low_rank, ring_update, softmax_with_sink,
                                                 window_keys)
from tidejax.models.layers.linear import HIGHEST, Linear
from tidejax.models.layers.mhc import hc_collapse, hc_expand, hc_head, hc_mixes, mhc_params
from tidejax.models.layers.norm import RMSNorm
from tidejax.models.layers.rope import RopeConfig, rope_cos_sin, rope_frequencies, rope_tail
from tidejax.pallas import moe_grouped

F32 = jnp.float32
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclasses.dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rms_norm_eps: float
    main_rope: RopeConfig
    compress_rope: RopeConfig
    layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    hash_layers: tuple[int, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    tie_word_embeddings: bool = False
    source: str = ""

    def rate(self, layer: int) -> int:
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[self.layer_types[layer]]

    @staticmethod
    def from_file(path: str | os.PathLike) -> "V4Config":
        path = Path(path)
        path = path / "config.json" if path.is_dir() else path
        return V4Config.from_hf(read_json(path), str(path))

    @staticmethod
    def from_hf(raw: dict, source: str = "config.json") -> "V4Config":
        def req(name):
            if raw.get(name) is None:
                raise ConfigError(f"{source}: missing required field '{name}'")
            return raw[name]

        if raw.get("model_type") != "deepseek_v4":
            raise ConfigError(f"{source}: field 'model_type' = {raw.get('model_type')!r}, "
                              "expected 'deepseek_v4'")
        n = req("num_hidden_layers")
        head_dim = req("head_dim")
        factor = raw.get("partial_rotary_factor")
        rope_dim = int(head_dim * factor) if factor else int(raw.get("qk_rope_head_dim") or 64)
        layer_types = tuple(req("layer_types"))[:n]
        mlp_types = tuple(raw.get("mlp_layer_types") or ["hash_moe"] * 3 + ["moe"] * n)[:n]
        for field, values, allowed in (("layer_types", layer_types, (SLIDING, CSA, HCA)),
                                       ("mlp_layer_types", mlp_types, ("hash_moe", "moe"))):
            bad = [v for v in values if v not in allowed]
            if len(values) != n or bad:
                raise ConfigError(f"{source}: field '{field}' needs {n} entries from {allowed}")
        rates = raw.get("compress_rates") or {CSA: 4, HCA: 128}
        if raw.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
            raise ConfigError(f"{source}: field 'scoring_func' = {raw['scoring_func']!r} is not "
                              "supported (sqrtsoftplus)")
        rope = raw.get("rope_parameters") or {}
        if not isinstance(rope.get("main"), dict) or not isinstance(rope.get("compress"), dict):
            raise ConfigError(f"{source}: field 'rope_parameters' needs 'main' and 'compress'")
        max_pos = raw.get("max_position_embeddings", 4096)
        main = RopeConfig.from_hf({"rope_parameters": rope["main"]}, rope_dim, max_pos, source)
        compress = dataclasses.replace(
            RopeConfig.from_hf({"rope_parameters": rope["compress"]}, rope_dim, max_pos, source),
            attention_factor=1.0)
        return V4Config(
            vocab_size=req("vocab_size"), hidden_size=req("hidden_size"), num_layers=n,
            num_heads=req("num_attention_heads"), head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=req("q_lora_rank"), o_groups=req("o_groups"), o_lora_rank=req("o_lora_rank"),
            sliding_window=req("sliding_window"), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            main_rope=main, compress_rope=compress, layer_types=layer_types, csa_rate=rates[CSA],
            hca_rate=rates[HCA], index_heads=req("index_n_heads"), index_head_dim=req("index_head_dim"),
            index_topk=req("index_topk"), hc_mult=req("hc_mult"),
            hc_sinkhorn_iters=raw.get("hc_sinkhorn_iters", 20), hc_eps=float(raw.get("hc_eps", 1e-6)),
            hash_layers=tuple(i for i, t in enumerate(mlp_types) if t == "hash_moe"),
            n_routed_experts=req("n_routed_experts"), num_experts_per_tok=req("num_experts_per_tok"),
            moe_intermediate_size=req("moe_intermediate_size"),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(raw.get("swiglu_limit", 0.0)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), source=source)


@flax.struct.dataclass
class V4Cache:
    """Generation state, per layer (None where a layer has no such part):
    window [b, W-1, k]: the last window keys (= values), slot = position mod W-1;
    entries [b, G, k]: compressed entries (rotated), entry g pools positions g*r .. g*r+r-1;
    ring_kv, ring_gate [b, R, c]: raw projections of the last R positions (slot = position mod
      R; R = 2r for CSA, whose entries also read the previous window, r for HCA);
    index_keys [b, G, i_k], index_ring_kv, index_ring_gate [b, 2r, 2 i_k]: CSA's indexer."""

    window: tuple
    entries: tuple
    ring_kv: tuple
    ring_gate: tuple
    index_keys: tuple
    index_ring_kv: tuple
    index_ring_gate: tuple

    @staticmethod
    def create(cfg: "V4Config", batch: int, max_len: int) -> "V4Cache":
        def per_layer(make):
            return tuple(make(i, cfg.rate(i)) if cfg.rate(i) else None for i in range(cfg.num_layers))

        def csa(make):
            return per_layer(lambda i, r: make(r) if cfg.layer_types[i] == CSA else None)

        def zeros(*shape):
            return jnp.zeros((batch, *shape), F32)

        k, ik = cfg.head_dim, cfg.index_head_dim
        overlap = {CSA: 2, HCA: 1}
        return V4Cache(
            window=tuple(zeros(cfg.sliding_window - 1, k) for _ in range(cfg.num_layers)),
            entries=per_layer(lambda i, r: zeros(max_len // r, k)),
            ring_kv=per_layer(lambda i, r: zeros(overlap[cfg.layer_types[i]] * r,
                                                 overlap[cfg.layer_types[i]] * k)),
            ring_gate=per_layer(lambda i, r: zeros(overlap[cfg.layer_types[i]] * r,
                                                   overlap[cfg.layer_types[i]] * k)),
            index_keys=csa(lambda r: zeros(max_len // r, ik)),
            index_ring_kv=csa(lambda r: zeros(2 * r, 2 * ik)),
            index_ring_gate=csa(lambda r: zeros(2 * r, 2 * ik)))


class Pooler(nn.Module):
    """Softmax-gated pooling of `rate` tokens into one entry of width `width`, rotated with the
    compress RoPE at the window's first position; learned position bias on the gate. overlap:
    CSA's layout (see layers.compress.pool_groups)."""

    cfg: V4Config
    rate: int
    width: int
    overlap: bool

    @nn.compact
    def __call__(self, x, positions, n_valid, store, ring_kv, ring_gate):
        """x [b, t, d] -> store [b, G, width] with the completed entries written, rings."""
        c = self.width * (2 if self.overlap else 1)
        kv = Linear(c, name="kv_proj")(x).astype(F32)
        bias = self.param("position_bias", nn.initializers.zeros, (self.rate, c), F32)
        gate = Linear(c, name="gate_proj")(x).astype(F32)
        start = positions[:, 0]
        latent, group, complete = jax.vmap(pool_groups, (0, 0, 0, 0, 0, 0, None, None, None))(
            kv, gate, ring_kv, ring_gate, start, n_valid, self.rate, bias, self.overlap)
        latent = RMSNorm(self.cfg.rms_norm_eps, name="kv_norm")(latent)
        inv_freq, _ = rope_frequencies(self.cfg.compress_rope)
        cos, sin = rope_cos_sin(group * self.rate, inv_freq)
        store = scatter_rows(store, rope_tail(latent, cos, sin), group, complete)
        update = jax.vmap(ring_update)
        return store, update(ring_kv, kv, start, n_valid), update(ring_gate, gate, start, n_valid)


class Attention(nn.Module):
    cfg: V4Config
    layer: int

    @nn.compact
    def __call__(self, x, positions, n_valid, window, state):
        """x [b, t, d] (normed), positions [b, t] -> y [b, t, d], window ring, state (this layer's
        compressed-branch cache parts, updated)."""
        cfg = self.cfg
        b, t, _ = x.shape
        h, k = cfg.num_heads, cfg.head_dim
        kind, rate = cfg.layer_types[self.layer], cfg.rate(self.layer)
        inv_freq, _ = rope_frequencies(cfg.main_rope if kind == SLIDING else cfg.compress_rope)
        cos, sin = rope_cos_sin(positions, inv_freq)
        q_res = RMSNorm(cfg.rms_norm_eps, name="q_a_norm")(Linear(cfg.q_lora_rank, name="q_a_proj")(x))
        q = Linear(h * k, name="q_b_proj")(q_res).reshape(b, t, h, k).astype(F32)
        q = q * jax.lax.rsqrt(jnp.mean(q * q, -1, keepdims=True) + cfg.rms_norm_eps)
        q = rope_tail(q, cos, sin)
        kv = rope_tail(RMSNorm(cfg.rms_norm_eps, name="kv_norm")(Linear(k, name="kv_proj")(x)),
                           cos, sin).astype(F32)
        keys, mask, window = window_keys(window, kv, positions, n_valid, cfg.sliding_window)
        if kind != SLIDING:
            comp = _Compressor(cfg, rate, kind == CSA, name="compressor")
            entries, ring_kv, ring_gate = comp.main(x, positions, n_valid, *state[:3])
            visible = jnp.arange(entries.shape[1])[None, None] < ((positions + 1) // rate)[..., None]
            if kind == CSA:
                scores, index_state = comp.indexer(x, q_res, positions, n_valid, visible, *state[3:])
                ids, valid = jax.vmap(top_k_select, (0, None))(scores, cfg.index_topk)
                visible = jax.vmap(selection_mask, (0, 0, None))(ids, valid, entries.shape[1])
                state = (entries, ring_kv, ring_gate, *index_state)
            else:
                state = (entries, ring_kv, ring_gate)
            keys = jnp.concatenate([keys, entries], 1)
            mask = jnp.concatenate([mask, visible], 2)
        logits = jnp.einsum("bthk,bsk->bhts", q, keys, precision=HIGHEST) * k ** -0.5
        logits = jnp.where(mask[:, None], logits, -jnp.inf)
        probs = softmax_with_sink(logits, self.param("sinks", nn.initializers.zeros, (h,), F32))
        out = jnp.einsum("bhts,bsk->bthk", probs, keys, precision=HIGHEST)
        out = rope_tail(out, cos, sin, inverse=True).astype(x.dtype)
        wo_a = self.param("o_a_proj", nn.initializers.normal(0.02),
                          (cfg.o_groups * cfg.o_lora_rank, h * k // cfg.o_groups), F32)
        y = Linear(cfg.hidden_size, name="o_b_proj")(grouped_low_rank(out, wo_a, cfg.o_groups))
        return y, window, state


class _Compressor(nn.Module):
    cfg: V4Config
    rate: int
    overlap: bool

    def setup(self):
        cfg = self.cfg
        self.main = Pooler(cfg, self.rate, cfg.head_dim, self.overlap)
        if self.overlap:
            self.indexer = Indexer(cfg, self.rate)


class Indexer(nn.Module):
    """CSA's lightning indexer, with its own overlapping compressor at index_head_dim."""

    cfg: V4Config
    rate: int

    @nn.compact
    def __call__(self, x, q_res, positions, n_valid, visible, keys, ring_kv, ring_gate):
        """-> scores [b, t, G] (-inf where invisible), (keys, ring_kv, ring_gate) updated."""
        cfg = self.cfg
        b, t, _ = x.shape
        keys, ring_kv, ring_gate = Pooler(cfg, self.rate, cfg.index_head_dim, True, name="keys")(
            x, positions, n_valid, keys, ring_kv, ring_gate)
        inv_freq, _ = rope_frequencies(cfg.compress_rope)
        cos, sin = rope_cos_sin(positions, inv_freq)
        q = Linear(cfg.index_heads * cfg.index_head_dim, name="q_b_proj")(q_res)
        q = rope_tail(q.reshape(b, t, cfg.index_heads, cfg.index_head_dim), cos, sin).astype(F32)
        s = jax.nn.relu(jnp.einsum("btik,bgk->btig", q, keys, precision=HIGHEST)) * cfg.index_head_dim ** -0.5
        w = Linear(cfg.index_heads, name="weights_proj")(x).astype(F32) * cfg.index_heads ** -0.5
        scores = jnp.einsum("btig,bti->btg", s, w, precision=HIGHEST)
        return jnp.where(visible, scores, -jnp.inf), (keys, ring_kv, ring_gate)


class MoE(nn.Module):
    cfg: V4Config
    layer: int

    @nn.compact
    def __call__(self, x, tokens, bank, kernel: str):
        cfg, limit = self.cfg, self.cfg.swiglu_limit
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        weight = self.param("gate_weight", nn.initializers.normal(0.02), (cfg.n_routed_experts, d), F32)
        scores = jnp.sqrt(jax.nn.softplus(jnp.einsum("td,ed->te", flat.astype(F32), weight,
                                                     precision=HIGHEST)))
        if self.layer in cfg.hash_layers:  # fixed token -> experts table
            table = self.param("tid2eid", nn.initializers.zeros,
                               (cfg.vocab_size, cfg.num_experts_per_tok), jnp.int32)
            ids = table[tokens.reshape(-1)]
        else:
            bias = self.param("gate_bias", nn.initializers.zeros, (cfg.n_routed_experts,), F32)
            _, ids = jax.lax.top_k(scores + bias, cfg.num_experts_per_tok)
        weights = jnp.take_along_axis(scores, ids, 1)
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
        y = moe_grouped(flat, bank, ids.astype(jnp.int32), weights, swiglu_limit=limit, impl=kernel)
        gate = Linear(cfg.moe_intermediate_size, name="gate_proj")(x).astype(F32)
        up = Linear(cfg.moe_intermediate_size, name="up_proj")(x).astype(F32)
        if limit > 0:
            gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        shared = Linear(d, name="down_proj")((jax.nn.silu(gate) * up).astype(x.dtype))
        return (y.reshape(b, t, d).astype(F32) + shared.astype(F32)).astype(x.dtype)


class DeepseekV4(nn.Module):
    cfg: V4Config
    kernel: str = "auto"

    @nn.compact
    def __call__(self, tokens, positions, token_mask, cache: V4Cache, experts):
        """tokens, positions [b, t]; token_mask [b, t] (real tokens first); experts: per layer a
        bank -> (logits [b, t, vocab] float32, cache). A full forward is a prefill into an empty
        cache."""
        cfg = self.cfg
        b, t = tokens.shape
        n, d = cfg.hc_mult, cfg.hidden_size
        n_valid = jnp.sum(token_mask, 1).astype(jnp.int32)
        embed = self.param("embed", nn.initializers.normal(1.0), (cfg.vocab_size, d), F32)
        streams = jnp.broadcast_to(jnp.take(embed, tokens, 0)[:, :, None], (b, t, n, d))
        mix = dict(eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters)

        parts = [list(p) for p in zip(cache.entries, cache.ring_kv, cache.ring_gate, cache.index_keys,
                                      cache.index_ring_kv, cache.index_ring_gate)]
        windows = list(cache.window)
        for i in range(cfg.num_layers):
            pre, post, comb = hc_mixes(streams, *mhc_params(self, f"layers_{i}_attn_hc", n, d), **mix)
            x = RMSNorm(cfg.rms_norm_eps, name=f"layers_{i}_input_layernorm")(
                hc_collapse(streams, pre))
            state = tuple(p for p in parts[i] if p is not None)
            y, windows[i], state = Attention(cfg, i, name=f"layers_{i}_self_attn")(
                x, positions, n_valid, windows[i], state)
            parts[i] = list(state) + [None] * (6 - len(state))
            streams = hc_expand(y, streams, post, comb)
            pre, post, comb = hc_mixes(streams, *mhc_params(self, f"layers_{i}_ffn_hc", n, d), **mix)
            x = RMSNorm(cfg.rms_norm_eps, name=f"layers_{i}_post_attention_layernorm")(
                hc_collapse(streams, pre))
            y = MoE(cfg, i, name=f"layers_{i}_mlp")(x, tokens, experts[i], self.kernel)
            streams = hc_expand(y, streams, post, comb)
        pre = hc_head(streams, *mhc_params(self, "hc_head", n, d, head=True), eps=cfg.rms_norm_eps,
                      hc_eps=cfg.hc_eps)
        x = RMSNorm(cfg.rms_norm_eps, name="norm")(hc_collapse(streams, pre))
        head = embed if cfg.tie_word_embeddings else self.param(
            "lm_head", nn.initializers.normal(0.02), (cfg.vocab_size, d), F32)
        logits = jnp.einsum("btd,vd->btv", x.astype(F32), head, precision=HIGHEST)
        cache = V4Cache(tuple(windows), *(tuple(p[j] for p in parts) for j in range(6)))
        return logits, cache


def full_forward(cfg: V4Config, params, banks, tokens, kernel: str = "auto"):
    """Logits [b, t, vocab] of tokens [b, t] at positions 0..t-1 (a prefill into a fresh cache)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, _ = DeepseekV4(cfg, kernel).apply(params, tokens, positions, positions >= 0,
                                              V4Cache.create(cfg, b, t), banks)
    return logits


# ---------------------------------------------------------------------------------------------
# transformers' tensor names -> our params

_RULES = [  # (regex on the name without "model.", replacement path with "/" separators)
    (r"^embed_tokens\.weight$", "embed"), (r"^lm_head\.weight$", "lm_head"),
    (r"^norm\.weight$", "norm/weight"), (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^layers\.(\d+)\.(attn_hc|ffn_hc)\.(fn|base|scale)$", r"layers_\1_\2_\3"),
    (r"^layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$", r"layers_\1_\2/weight"),
    (r"^layers\.(\d+)\.self_attn\.(o_a_proj)\.weight$", r"layers_\1_self_attn/\2"),
    (r"^layers\.(\d+)\.self_attn\.sinks$", r"layers_\1_self_attn/sinks"),
    (r"^layers\.(\d+)\.self_attn\.(q_a_proj|q_a_norm|q_b_proj|kv_proj|kv_norm|o_b_proj)\.weight$",
     r"layers_\1_self_attn/\2/weight"),
    (r"^layers\.(\d+)\.self_attn\.compressor\.(kv_proj|gate_proj|kv_norm)\.weight$",
     r"layers_\1_self_attn/compressor/main/\2/weight"),
    (r"^layers\.(\d+)\.self_attn\.compressor\.position_bias$",
     r"layers_\1_self_attn/compressor/main/position_bias"),
    (r"^layers\.(\d+)\.self_attn\.compressor\.indexer\.(kv_proj|gate_proj|kv_norm)\.weight$",
     r"layers_\1_self_attn/compressor/indexer/keys/\2/weight"),
    (r"^layers\.(\d+)\.self_attn\.compressor\.indexer\.position_bias$",
     r"layers_\1_self_attn/compressor/indexer/keys/position_bias"),
    (r"^layers\.(\d+)\.self_attn\.compressor\.indexer\.(q_b_proj)\.weight$",
     r"layers_\1_self_attn/compressor/indexer/\2/weight"),
    (r"^layers\.(\d+)\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.weight$",
     r"layers_\1_self_attn/compressor/indexer/weights_proj/weight"),
    (r"^layers\.(\d+)\.mlp\.gate\.weight$", r"layers_\1_mlp/gate_weight"),
    (r"^layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$", r"layers_\1_mlp/gate_bias"),
    (r"^layers\.(\d+)\.mlp\.gate\.tid2eid$", r"layers_\1_mlp/tid2eid"),
    (r"^layers\.(\d+)\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$",
     r"layers_\1_mlp/\2/weight"),
]
_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def load_state(cfg: V4Config, tensors: dict, source: str = "checkpoint") -> tuple[dict, list]:
    """transformers-named tensors (name -> array) -> ({"params": tree}, per-layer banks).
    Fails on any unmapped tensor, missing parameter or shape mismatch, naming it."""
    model = DeepseekV4(cfg, kernel="reference")
    e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    empty = [{"gate_up": jnp.zeros((e, 2 * i, d)), "down": jnp.zeros((e, d, i))}] * cfg.num_layers
    tok = jnp.zeros((1, 1), jnp.int32)
    shapes = flatten_dict(jax.eval_shape(lambda: model.init(
        jax.random.PRNGKey(0), tok, tok, tok >= 0, V4Cache.create(cfg, 1, 1), empty))["params"])
    params, banks = {}, [dict() for _ in range(cfg.num_layers)]
    for name, value in tensors.items():
        key = name.removeprefix("model.")
        if m := _EXPERTS.match(key):
            banks[int(m[1])]["gate_up" if m[2] == "gate_up_proj" else "down"] = jnp.asarray(value, F32)
            continue
        path = next((tuple(re.sub(rx, rep, key).split("/")) for rx, rep in _RULES if re.match(rx, key)), None)
        if path is None or path not in shapes:
            raise ConfigError(f"{source}: tensor {name} has no place in the model")
        if tuple(value.shape) != shapes[path].shape:
            raise ConfigError(f"{source}: tensor {name} has shape {tuple(value.shape)}, "
                              f"the config needs {shapes[path].shape}")
        params[path] = jnp.asarray(np.asarray(value), shapes[path].dtype)
    missing = [p for p in shapes if p not in params]
    if missing:
        raise ConfigError(f"{source}: no tensor for parameter {'/'.join(missing[0])}")
    for layer, bank in enumerate(banks):
        if set(bank) != {"gate_up", "down"}:
            raise ConfigError(f"{source}: layer {layer} lacks mlp.experts.gate_up_proj / down_proj")
    return {"params": unflatten_dict(params)}, banks


def load(model_dir) -> tuple[V4Config, dict, list]:
    """A transformers-layout folder (config.json + *.safetensors) -> (config, params, banks)."""
    from tidejax.models.deepseek_v41.weights import Tensors

    model_dir = Path(model_dir)
    cfg = V4Config.from_file(model_dir)
    tensors = Tensors(model_dir)
    arrays = {name: np.asarray(tensors.view(name)) for name in tensors.where}
    params, banks = load_state(cfg, arrays, str(model_dir))
    return cfg, params, banks
