"""DeepSeek-V4 (`deepseek_v4`, transformers 5.23+): the earlier architecture of the V4.1 line.

Shares with V4.1 (through tidejax.models.layers): mHC streams with Sinkhorn, latent single-KV
attention with a sliding window, sinks, interleaved tail RoPE and its inverse on the output, grouped low-rank
output, clamped SwiGLU, sqrtsoftplus routing. Its own: per-layer compressors of two kinds, CSA
(rate 4, overlapping windows: entry w pools window w-1's "Ca" half and window w's "Cb" half, with
a learned position bias, and its own indexer with its own compressor) and HCA (rate 128, no
overlap, no indexer: every visible entry attends); an unweighted norm on q per head; hash routing
(a fixed token -> experts table) in the first MoE layers; each mHC site collapses with its own
pre; a final hyper head. No QAT fake quantizers.

`DeepseekV4.__call__(tokens, positions, token_mask, cache, block_table, experts, replay=None)` is
the one forward for prefill chunks and decode steps (chunks contiguous per row, real tokens
first; a full forward is a prefill into an empty cache). Every layer's MoE is the shared layers.moe.MoE: its routed
experts are served by residency (bank, rowmap, miss policy; rowmap row = layer), so budgets and
miss policies apply as to the other families.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from tidejax.kv.paged import PagedCache
from tidejax.models.deepseek_v4.config import CSA, HCA, SLIDING, V4Config
from tidejax.models.layers.compress import pool_groups, scatter_rows, selection_mask, top_k_select
from tidejax.models.layers.latent_window import (grouped_low_rank, ring_update, softmax_with_sink,
                                                 window_keys)
from tidejax.models.layers.linear import HIGHEST, Linear
from tidejax.models.layers.mhc import hc_collapse, hc_expand, hc_head, hc_mixes, mhc_params
from tidejax.models.layers.moe import MoE, RouterSpec
from tidejax.models.layers.norm import RMSNorm
from tidejax.models.layers.rope import rope_cos_sin, rope_frequencies, rope_tail
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import ExpertState

F32 = jnp.float32


@flax.struct.dataclass
class V4Cache:
    """Generation state, per layer (None where a layer has no such part):
    window [b, W-1, k]: the last window keys (= values), slot = position mod W-1;
    entries [b, G, k]: compressed entries (rotated), entry g pools positions g*r .. g*r+r-1;
    ring_kv, ring_gate [b, R, c]: raw projections of the last R positions (slot = position mod
      R; R = 2r for CSA, whose entries also read the previous window, r for HCA);
    index_keys [b, G, i_k], index_ring_kv, index_ring_gate [b, 2r, 2 i_k]: CSA's indexer.
    The window, entries and index keys are in the cache's dtype; the rings hold raw projections
    and stay float32."""

    window: tuple
    entries: tuple
    ring_kv: tuple
    ring_gate: tuple
    index_keys: tuple
    index_ring_kv: tuple
    index_ring_gate: tuple

    @staticmethod
    def create(cfg: "V4Config", batch: int, max_len: int, dtype=F32) -> "V4Cache":
        def per_layer(make):
            return tuple(make(i, cfg.rate(i)) if cfg.rate(i) else None for i in range(cfg.num_layers))

        def csa(make):
            return per_layer(lambda i, r: make(r) if cfg.layer_types[i] == CSA else None)

        def zeros(*shape, dt=F32):
            return jnp.zeros((batch, *shape), dt)

        k, ik = cfg.head_dim, cfg.index_head_dim
        overlap = {CSA: 2, HCA: 1}
        return V4Cache(
            window=tuple(zeros(cfg.sliding_window - 1, k, dt=dtype) for _ in range(cfg.num_layers)),
            entries=per_layer(lambda i, r: zeros(max_len // r, k, dt=dtype)),
            ring_kv=per_layer(lambda i, r: zeros(overlap[cfg.layer_types[i]] * r,
                                                 overlap[cfg.layer_types[i]] * k)),
            ring_gate=per_layer(lambda i, r: zeros(overlap[cfg.layer_types[i]] * r,
                                                   overlap[cfg.layer_types[i]] * k)),
            index_keys=csa(lambda r: zeros(max_len // r, ik, dt=dtype)),
            index_ring_kv=csa(lambda r: zeros(2 * r, 2 * ik)),
            index_ring_gate=csa(lambda r: zeros(2 * r, 2 * ik)))

    @staticmethod
    def bytes_per_token(cfg: "V4Config", dtype=F32) -> float:
        """Cache bytes that grow with the context: each compressed layer's entries (and a CSA
        layer's index keys), one per `rate` positions (the window rings and rings are fixed)."""
        per = sum((cfg.head_dim + (cfg.index_head_dim if cfg.layer_types[i] == CSA else 0))
                  / cfg.rate(i) for i in range(cfg.num_layers) if cfg.rate(i))
        return per * jnp.dtype(dtype).itemsize


class Pooler(nn.Module):
    """Softmax-gated pooling of `rate` tokens into one entry of width `width`, rotated with the
    compress RoPE at the window's first position; learned position bias on the gate. overlap:
    CSA's layout (see layers.compress.pool_groups)."""

    cfg: V4Config
    rate: int
    width: int
    overlap: bool
    dtype: jnp.dtype = F32  # of the projections (the bias and the norm stay float32)

    @nn.compact
    def __call__(self, x, positions, n_valid, store, ring_kv, ring_gate):
        """x [b, t, d] -> store [b, G, width] with the completed entries written, rings."""
        c = self.width * (2 if self.overlap else 1)
        kv = Linear(c, self.dtype, name="kv_proj")(x).astype(F32)
        bias = self.param("position_bias", nn.initializers.zeros, (self.rate, c), F32)
        gate = Linear(c, self.dtype, name="gate_proj")(x).astype(F32)
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
    dtype: jnp.dtype = F32  # of the projections (the norms and sinks stay float32)

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
        dt = self.dtype
        q_res = RMSNorm(cfg.rms_norm_eps, name="q_a_norm")(Linear(cfg.q_lora_rank, dt, name="q_a_proj")(x))
        q = Linear(h * k, dt, name="q_b_proj")(q_res).reshape(b, t, h, k).astype(F32)
        q = q * jax.lax.rsqrt(jnp.mean(q * q, -1, keepdims=True) + cfg.rms_norm_eps)
        q = rope_tail(q, cos, sin)
        kv = rope_tail(RMSNorm(cfg.rms_norm_eps, name="kv_norm")(Linear(k, dt, name="kv_proj")(x)),
                           cos, sin).astype(F32)
        keys, mask, window = window_keys(window, kv, positions, n_valid, cfg.sliding_window)
        if kind != SLIDING:
            comp = _Compressor(cfg, rate, kind == CSA, dt, name="compressor")
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
                          (cfg.o_groups * cfg.o_lora_rank, h * k // cfg.o_groups), dt)
        y = Linear(cfg.hidden_size, dt, name="o_b_proj")(grouped_low_rank(out, wo_a, cfg.o_groups))
        return y, window, state


class _Compressor(nn.Module):
    cfg: V4Config
    rate: int
    overlap: bool
    dtype: jnp.dtype = F32  # of the projections

    def setup(self):
        cfg = self.cfg
        self.main = Pooler(cfg, self.rate, cfg.head_dim, self.overlap, self.dtype)
        if self.overlap:
            self.indexer = Indexer(cfg, self.rate, self.dtype)


class Indexer(nn.Module):
    """CSA's lightning indexer, with its own overlapping compressor at index_head_dim."""

    cfg: V4Config
    rate: int
    dtype: jnp.dtype = F32  # of the projections

    @nn.compact
    def __call__(self, x, q_res, positions, n_valid, visible, keys, ring_kv, ring_gate):
        """-> scores [b, t, G] (-inf where invisible), (keys, ring_kv, ring_gate) updated."""
        cfg = self.cfg
        b, t, _ = x.shape
        keys, ring_kv, ring_gate = Pooler(cfg, self.rate, cfg.index_head_dim, True, self.dtype,
                                          name="keys")(
            x, positions, n_valid, keys, ring_kv, ring_gate)
        inv_freq, _ = rope_frequencies(cfg.compress_rope)
        cos, sin = rope_cos_sin(positions, inv_freq)
        q = Linear(cfg.index_heads * cfg.index_head_dim, self.dtype, name="q_b_proj")(q_res)
        q = rope_tail(q.reshape(b, t, cfg.index_heads, cfg.index_head_dim), cos, sin).astype(F32)
        s = jax.nn.relu(jnp.einsum("btik,bgk->btig", q, keys, precision=HIGHEST)) * cfg.index_head_dim ** -0.5
        w = Linear(cfg.index_heads, self.dtype, name="weights_proj")(x).astype(F32) * cfg.index_heads ** -0.5
        scores = jnp.einsum("btig,bti->btg", s, w, precision=HIGHEST)
        return jnp.where(visible, scores, -jnp.inf), (keys, ring_kv, ring_gate)


def router_spec(cfg: V4Config, layer: int) -> RouterSpec:
    """sqrtsoftplus scores; the picks from scores + correction bias, or in the hash layers from a
    fixed token -> experts table (tid2eid); weights always normalized, then scaled."""
    hashed = layer in cfg.hash_layers
    return RouterSpec(n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
                      scoring="sqrtsoftplus", use_bias=not hashed,
                      hash_vocab=cfg.vocab_size if hashed else 0,
                      routed_scaling_factor=cfg.routed_scaling_factor)


class DeepseekV4(nn.Module):
    cfg: V4Config
    serve: ServeOptions  # how routed experts are served (kernel, miss policy); see residency
    dtype: jnp.dtype = F32  # of the dense params but the norms, mHC, sinks, position biases and
    # routers (float32, as the reference keeps them)

    @nn.compact
    def __call__(self, tokens, positions, token_mask, paged: PagedCache, block_table,
                 experts: ExpertState, replay=None):
        """tokens, positions [b, t]; token_mask [b, t] (real tokens first); paged: the engine's
        cache, whose per-lane part `lanes` is this model's whole V4Cache (its pool part is empty,
        so block_table [b, P] addresses nothing); experts: the residency state (every layer is a
        MoE layer, rowmap row = layer); replay [b, t, layers, k]: recorded picks to route by,
        hash layers included (None: the routers and hash tables choose) -> (logits [b, t, vocab]
        float32, paged, experts)."""
        del block_table  # no pages: every cache row is the lane's own
        cache = paged.lanes
        cfg = self.cfg
        b, t = tokens.shape
        n, d = cfg.hc_mult, cfg.hidden_size
        n_valid = jnp.sum(token_mask, 1).astype(jnp.int32)
        embed = self.param("embed", nn.initializers.normal(1.0), (cfg.vocab_size, d), self.dtype)
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
            y, windows[i], state = Attention(cfg, i, self.dtype, name=f"layers_{i}_self_attn")(
                x, positions, n_valid, windows[i], state)
            parts[i] = list(state) + [None] * (6 - len(state))
            streams = hc_expand(y, streams, post, comb)
            pre, post, comb = hc_mixes(streams, *mhc_params(self, f"layers_{i}_ffn_hc", n, d), **mix)
            x = RMSNorm(cfg.rms_norm_eps, name=f"layers_{i}_post_attention_layernorm")(
                hc_collapse(streams, pre))
            y, experts = MoE(router_spec(cfg, i), i, cfg.moe_intermediate_size, self.serve, self.dtype,
                             act_dtype=F32, name=f"layers_{i}_mlp")(x, token_mask, experts, tokens,
                                                                    replay=replay)
            streams = hc_expand(y, streams, post, comb)
        pre = hc_head(streams, *mhc_params(self, "hc_head", n, d, head=True), eps=cfg.rms_norm_eps,
                      hc_eps=cfg.hc_eps)
        x = RMSNorm(cfg.rms_norm_eps, name="norm")(hc_collapse(streams, pre))
        head = embed if cfg.tie_word_embeddings else self.param(
            "lm_head", nn.initializers.normal(0.02), (cfg.vocab_size, d), self.dtype)
        logits = jnp.einsum("btd,vd->btv", x.astype(F32), head.astype(F32), precision=HIGHEST)
        cache = V4Cache(tuple(windows), *(tuple(p[j] for p in parts) for j in range(6)))
        return logits, PagedCache(paged.pages, cache), experts
