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
first; a full forward is a prefill into an empty cache). The cache is a kv.paged.PagedCache: the
compressed layers' entries and CSA's indexer keys in the shared page pool (V4Pages, read through
each row's block table, so attention and the indexer cost what the row holds), the window rings
and the compressors' rings per row (V4Lanes). Every layer's MoE is the shared layers.moe.MoE: its
routed experts are served by residency (bank, rowmap, miss policy; rowmap row = layer), so
budgets and miss policies apply as to the other families.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from tidejax import ops
from tidejax.contract import hc_collapse
from tidejax.kv import paged
from tidejax.kv.paged import PagedCache
from tidejax.models.base import ParamSpec, declare, serving
from tidejax.models.deepseek_v4.config import CSA, SLIDING, V4Config
from tidejax.models.layers.compress import pool_groups, top_k_select
from tidejax.models.layers.latent_window import (attend_with_sink, attention_specs,
                                                 GroupedLowRank, ring_update, window_keys)
from tidejax.models.layers.linear import Linear, embedding_specs, linear_specs, lm_logits
from tidejax.models.layers.mhc import hc_expand, hc_head, mhc_params
from tidejax.models.layers.moe import MoE, RouterSpec
from tidejax.models.layers.norm import RMSNorm, norm_specs
from tidejax.models.layers.rope import rope_cos_sin, rope_frequencies, rope_tail
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import ExpertState

F32 = jnp.float32
# layers.latent_window's attention params, as the model names them (transformers' names)
ATTN_NAMES = {"q_a": "q_a_proj", "q_norm": "q_a_norm", "q_b": "q_b_proj", "kv": "kv_proj",
              "kv_norm": "kv_norm", "sink": "sinks", "o_a": "o_a_proj", "o_b": "o_b_proj"}


@flax.struct.dataclass
class V4Pages:
    """The context-growing cache, in the shared KV pool (tidejax.kv.paged), per layer (None where
    a layer has no such part): entries [n_pages, page_size // r, k], a compressed layer's entries
    (rotated; entry g pools positions g*r .. g*r+r-1, r its rate), and index_keys [n_pages,
    page_size // r, i_k], a CSA layer's indexer keys. A sequence's block table addresses every
    leaf with the same page ids: entry g lives in its page g // (page_size // r), row
    g % (page_size // r); so page_size is a multiple of every rate (`V4Config.page_multiple`)."""

    entries: tuple
    index_keys: tuple

    @staticmethod
    def create(cfg: V4Config, n_pages: int, page_size: int, dtype=F32) -> "V4Pages":
        if page_size % cfg.page_multiple:
            raise ValueError(f"page_size {page_size} is not a multiple of every compressed "
                             f"layer's rate (their least common multiple: {cfg.page_multiple})")

        def pool(i, width):
            return jnp.zeros((n_pages, page_size // cfg.rate(i), width), dtype)

        layers = range(cfg.num_layers)
        return V4Pages(
            entries=tuple(pool(i, cfg.head_dim) if cfg.rate(i) else None for i in layers),
            index_keys=tuple(pool(i, cfg.index_head_dim) if cfg.layer_types[i] == CSA else None
                             for i in layers))

    def axes(self) -> "V4Pages":
        """The logical axes of each pool leaf (tidejax.parallel): the single latent KV head and
        the index keys are not split across heads."""
        def leaf_axes(leaves):
            return tuple(None if leaf is None else ("pages", "page", None) for leaf in leaves)

        return V4Pages(entries=leaf_axes(self.entries), index_keys=leaf_axes(self.index_keys))

    @staticmethod
    def bytes_per_token(cfg: V4Config, dtype=F32) -> float:
        """Pool bytes a token of context adds: each compressed layer's entries (and a CSA layer's
        index keys), one per `rate` positions (the per-lane rings are fixed)."""
        per = sum((cfg.head_dim + (cfg.index_head_dim if cfg.layer_types[i] == CSA else 0))
                  / cfg.rate(i) for i in range(cfg.num_layers) if cfg.rate(i))
        return per * jnp.dtype(dtype).itemsize


@flax.struct.dataclass
class V4Lanes:
    """The fixed-size cache rows of each decode lane, per layer (None where a layer has no such
    part): window [lanes, W-1, k], the last window keys (= values), slot = position mod W-1;
    ring_kv, ring_gate [lanes, R, c]: raw projections of a compressed layer's last R positions
    (slot = position mod R; R = 2r for CSA, whose entries also read the previous window, r for
    HCA); index_ring_kv, index_ring_gate [lanes, 2r, 2 i_k]: CSA's indexer's. The window is in
    the cache's dtype; the rings hold raw projections and stay float32."""

    window: tuple
    ring_kv: tuple
    ring_gate: tuple
    index_ring_kv: tuple
    index_ring_gate: tuple

    @staticmethod
    def create(cfg: V4Config, lanes: int, dtype=F32) -> "V4Lanes":
        def ring(i, width, csa_only=False):
            kind = cfg.layer_types[i]
            if kind == SLIDING or (csa_only and kind != CSA):
                return None
            overlap = 2 if kind == CSA else 1
            return jnp.zeros((lanes, overlap * cfg.rate(i), overlap * width), F32)

        k, ik, layers = cfg.head_dim, cfg.index_head_dim, range(cfg.num_layers)
        return V4Lanes(
            window=tuple(jnp.zeros((lanes, cfg.sliding_window - 1, k), dtype) for _ in layers),
            ring_kv=tuple(ring(i, k) for i in layers), ring_gate=tuple(ring(i, k) for i in layers),
            index_ring_kv=tuple(ring(i, ik, True) for i in layers),
            index_ring_gate=tuple(ring(i, ik, True) for i in layers))


def pooler_specs(cfg: V4Config, rate: int, width: int, overlap: bool, dtype) -> dict:
    """Pooler's declared params: `rate` tokens pooled into one entry of `width` (CSA: overlapping
    windows, so twice the projections)."""
    c, d = width * (2 if overlap else 1), cfg.hidden_size
    return {"kv_proj": linear_specs(c, d, (None, "embed"), dtype),
            "gate_proj": linear_specs(c, d, (None, "embed"), dtype),
            "position_bias": ParamSpec((rate, c), F32, (None, None), init="zeros"),
            "kv_norm": norm_specs(width, None, F32)}


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
    def __call__(self, x, positions, n_valid, pool, block_table, ring_kv, ring_gate):
        """x [b, t, d] -> pool [n_pages, page_size // rate, width] with the completed entries
        written at their rows' pages (block_table [b, P]), rings."""
        c = self.width * (2 if self.overlap else 1)
        kv = Linear(c, self.dtype, name="kv_proj")(x).astype(F32)
        bias = declare(self, pooler_specs(self.cfg, self.rate, self.width, self.overlap,
                                          self.dtype))["position_bias"]
        gate = Linear(c, self.dtype, name="gate_proj")(x).astype(F32)
        start = positions[:, 0]
        latent, group, complete = jax.vmap(pool_groups, (0, 0, 0, 0, 0, 0, None, None, None))(
            kv, gate, ring_kv, ring_gate, start, n_valid, self.rate, bias, self.overlap)
        latent = RMSNorm(self.cfg.rms_norm_eps, name="kv_norm")(latent)
        inv_freq, _ = rope_frequencies(self.cfg.compress_rope)
        cos, sin = rope_cos_sin(group * self.rate, inv_freq)
        slots = paged.token_slots(block_table, group, complete, *pool.shape[:2])
        pool = paged.write(pool, rope_tail(latent, cos, sin), slots)
        update = jax.vmap(ring_update)
        return pool, update(ring_kv, kv, start, n_valid), update(ring_gate, gate, start, n_valid)


class Attention(nn.Module):
    cfg: V4Config
    layer: int
    dtype: jnp.dtype = F32  # of the projections (the norms and sinks stay float32)

    @nn.compact
    def __call__(self, x, positions, n_valid, window, state, block_table):
        """x [b, t, d] (normed), positions [b, t] -> y [b, t, d], window ring, state (this layer's
        compressed-branch cache parts, updated: its pools and its lane rings); block_table [b, P]
        each row's pages. An HCA layer attends every visible entry of the row's pages, a CSA
        layer only the entries its indexer picks, read by id."""
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
        extra = extra_mask = None
        if kind != SLIDING:
            comp = _Compressor(cfg, rate, kind == CSA, dt, name="compressor")
            entries, ring_kv, ring_gate = comp.main(x, positions, n_valid, state[0], block_table,
                                                    *state[1:3])
            counts = (positions + 1) // rate  # [b, t]: the entries each query sees
            if kind == CSA:
                scores, index_state = comp.indexer(x, q_res, positions, n_valid, counts,
                                                   block_table, *state[3:])
                ids, extra_mask = jax.vmap(top_k_select, (0, None))(scores, cfg.index_topk)
                extra = paged.gather_rows(entries, block_table, ids)  # [b, t, j, k]
                state = (entries, ring_kv, ring_gate, *index_state)
            else:
                extra = paged.gather(entries, block_table)  # [b, P * rows, k]
                extra_mask = jnp.arange(extra.shape[1])[None, None] < counts[..., None]
                state = (entries, ring_kv, ring_gate)
            extra = extra.astype(x.dtype)
        p = declare(self, attention_specs(cfg, ATTN_NAMES, dt, F32))
        sinks = p["sinks"]
        out = attend_with_sink(q.astype(x.dtype), keys.astype(x.dtype), mask, sinks, extra,
                               extra_mask)
        out = rope_tail(out, cos, sin, inverse=True).astype(x.dtype)
        low_rank = GroupedLowRank(cfg.o_groups, cfg.o_lora_rank, dt, name="o_a_proj")(out)
        y = Linear(cfg.hidden_size, dt, name="o_b_proj")(low_rank)
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
    def __call__(self, x, q_res, positions, n_valid, counts, block_table, keys, ring_kv, ring_gate):
        """counts [b, t]: the entries each query sees -> scores [b, t, P * rows] (-inf past
        them), (keys: the pool, ring_kv, ring_gate) updated."""
        cfg = self.cfg
        b, t, _ = x.shape
        keys, ring_kv, ring_gate = Pooler(cfg, self.rate, cfg.index_head_dim, True, self.dtype,
                                          name="keys")(
            x, positions, n_valid, keys, block_table, ring_kv, ring_gate)
        inv_freq, _ = rope_frequencies(cfg.compress_rope)
        cos, sin = rope_cos_sin(positions, inv_freq)
        q = Linear(cfg.index_heads * cfg.index_head_dim, self.dtype, name="q_b_proj")(q_res)
        q = rope_tail(q.reshape(b, t, cfg.index_heads, cfg.index_head_dim), cos, sin).astype(F32)
        w = Linear(cfg.index_heads, self.dtype, name="weights_proj")(x).astype(F32) * cfg.index_heads ** -0.5
        scores = ops.paged_index_scores(q, w, keys, block_table, counts,
                                        scale=cfg.index_head_dim ** -0.5)
        return scores, (keys, ring_kv, ring_gate)


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
    serve: ServeOptions  # how routed experts are served (miss policy) and the ops run (kernel)
    dtype: jnp.dtype = F32  # of the dense params but the norms, mHC, sinks, position biases and
    # routers (float32, as the reference keeps them)

    @nn.compact
    @serving
    def __call__(self, tokens, positions, token_mask, cache: PagedCache, block_table,
                 experts: ExpertState, replay=None, logits_at=None):
        """tokens, positions [b, t]; token_mask [b, t] (real tokens first); cache: V4Pages (the
        shared pool) and V4Lanes (one row per batch row); block_table [b, P] int32: each row's
        pages in the pool; experts: the residency state (every layer is a MoE layer, rowmap row
        = layer); replay [b, t, layers, k]: recorded picks to route by, hash layers included
        (None: the routers and hash tables choose); logits_at [b]: the one position of each row to
        compute logits at (None: all) -> (logits [b, t or 1, vocab] float32, cache, experts)."""
        cfg = self.cfg
        b, t = tokens.shape
        n, d = cfg.hc_mult, cfg.hidden_size
        n_valid = jnp.sum(token_mask, 1).astype(jnp.int32)
        embedding = declare(self, embedding_specs(cfg.vocab_size, d, self.dtype,
                                                  cfg.tie_word_embeddings))
        streams = jnp.broadcast_to(jnp.take(embedding["embed"], tokens, 0)[:, :, None],
                                   (b, t, n, d))
        mix = dict(eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters)

        pages, lanes = cache.pages, cache.lanes
        parts = [list(p) for p in zip(pages.entries, lanes.ring_kv, lanes.ring_gate, pages.index_keys,
                                      lanes.index_ring_kv, lanes.index_ring_gate)]
        windows = list(lanes.window)
        for i in range(cfg.num_layers):
            _, post, comb, x = ops.mhc_front(
                streams, *mhc_params(self, f"layers_{i}_attn_hc", n, d), **mix)
            x = RMSNorm(cfg.rms_norm_eps, name=f"layers_{i}_input_layernorm")(x)
            state = tuple(p for p in parts[i] if p is not None)
            y, windows[i], state = Attention(cfg, i, self.dtype, name=f"layers_{i}_self_attn")(
                x, positions, n_valid, windows[i], state, block_table)
            parts[i] = list(state) + [None] * (6 - len(state))
            streams = hc_expand(y, streams, post, comb)
            _, post, comb, x = ops.mhc_front(
                streams, *mhc_params(self, f"layers_{i}_ffn_hc", n, d), **mix)
            x = RMSNorm(cfg.rms_norm_eps, name=f"layers_{i}_post_attention_layernorm")(x)
            y, experts = MoE(router_spec(cfg, i), i, cfg.moe_intermediate_size, self.serve, self.dtype,
                             act_dtype=F32, name=f"layers_{i}_mlp")(x, token_mask, experts, tokens,
                                                                    replay=replay)
            streams = hc_expand(y, streams, post, comb)
        pre = hc_head(streams, *mhc_params(self, "hc_head", n, d, head=True), eps=cfg.rms_norm_eps,
                      hc_eps=cfg.hc_eps)
        x = RMSNorm(cfg.rms_norm_eps, name="norm")(hc_collapse(streams, pre))
        head = embedding["embed" if cfg.tie_word_embeddings else "lm_head"]
        logits = lm_logits(x, head, logits_at)
        entries, ring_kv, ring_gate, index_keys, index_ring_kv, index_ring_gate = (
            tuple(p[j] for p in parts) for j in range(6))
        cache = PagedCache(V4Pages(entries, index_keys),
                           V4Lanes(tuple(windows), ring_kv, ring_gate, index_ring_kv, index_ring_gate))
        return logits, cache, experts
