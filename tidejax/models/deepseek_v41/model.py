"""DeepSeek-V4.1 (and the Flash checkpoints): mHC residual streams, latent single-KV attention
with a sliding window, CSA2 compressed branches shared across layers with indexers, Engram
n-gram memory, and a sqrtsoftplus-routed MoE (the shared layers.moe.MoE).

`DeepseekV41.__call__(tokens, positions, token_mask, cache, block_table, experts, engram)`
is the one forward for prefill chunks, decode steps and full-sequence scoring (a full forward is a
prefill into an empty cache, which is also how the reference computes its logits). A row's chunk
must be contiguous (positions start..start+t-1) with its real tokens first (token_mask a prefix).
The cache is a kv.paged.PagedCache: the compressed entries and indexer keys in the shared page
pool (V41Pages, read through each row's block table, so the attention and the indexer cost what
the row holds), the window rings, group buffers and Engram look-back per row (V41Lanes). The
Engram rows are hashed and read inside the forward (engram.py) from the tokens it is given.

Semantics follow the reference's cached path (ARCHITECTURE.md in the V4.1 goldens): the window
KV is FP8 fake-quantized; a KV source pools its tokens into compressed entries (FP4) and indexer
keys (FP4) that the following compressed layers share; index sources select, per query, which
compressed entries the layers up to the next index source may attend.

Einsum letters (see layers/__init__.py): b batch, t queries, s keys, g compressed entries, h heads,
k head width, d model width, n streams (hc), i index heads.
"""

from __future__ import annotations

import itertools
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from tidejax import ops
from tidejax.contract import hc_collapse
from tidejax.kv import paged
from tidejax.kv.paged import PagedCache
from tidejax.models.base import ParamSpec, declare, serving
from tidejax.models.deepseek_v41.config import V41Config
from tidejax.models.deepseek_v41.engram import EngramTables, dequantized, gather_rows, hash_ids
from tidejax.models.layers.compress import (candidate_blocks, pool_groups, selection_mask,
                                            top_k_select)
from tidejax.models.layers.latent_window import (attend_with_sink, attention_specs,
                                                 GroupedLowRank, ring_update, window_keys)
from tidejax.models.layers.linear import Linear, embedding_specs, linear_specs, lm_logits
from tidejax.models.layers.mhc import hc_expand, mhc_params
from tidejax.models.layers.moe import MoE, RouterSpec
from tidejax.models.layers.norm import RMSNorm
from tidejax.models.layers.qat import fake_quant_fp4, fake_quant_fp8
from tidejax.models.layers.rope import rope_cos_sin, rope_frequencies, rope_tail
from tidejax.residency.serve import ServeOptions
from tidejax.residency.state import ExpertState

F32 = jnp.float32
# layers.latent_window's attention params, as the model names them (the reference's names)
ATTN_NAMES = {"q_a": "wq_a", "q_norm": "q_norm", "q_b": "wq_b", "kv": "wkv", "kv_norm": "kv_norm",
              "sink": "attn_sink", "o_a": "wo_a", "o_b": "wo_b"}


@flax.struct.dataclass
class V41Pages:
    """The context-growing cache, in the shared KV pool (tidejax.kv.paged): per KV source of
    ratio r, entries [n_pages, page_size // r, k] (compressed entries, rotated, FP4) and
    index_keys [n_pages, page_size // r, i_k] (None where the source owns no indexer keys). A
    sequence's block table addresses every source's leaf with the same page ids: entry g of a row
    lives in its page g // (page_size // r) and covers positions g*r .. g*r+r-1. The number of
    emitted entries is implicit: a row that has seen p positions has p // r."""

    entries: tuple
    index_keys: tuple

    @staticmethod
    def create(cfg: V41Config, n_pages: int, page_size: int, dtype=F32) -> "V41Pages":
        if page_size % cfg.page_multiple:
            raise ValueError(f"page_size {page_size} is not a multiple of every KV source's "
                             f"compress ratio (their least common multiple: {cfg.page_multiple})")

        def pool(source, width):
            return jnp.zeros((n_pages, page_size // cfg.compress_ratios[source], width), dtype)

        return V41Pages(
            entries=tuple(pool(s, cfg.head_dim) for s in cfg.kv_sources),
            index_keys=tuple(pool(s, cfg.index_head_dim) if cfg.owns_index_keys(s) else None
                             for s in cfg.kv_sources))

    def axes(self) -> "V41Pages":
        """The logical axes of each pool leaf (tidejax.parallel): the single latent KV head and
        the index keys are not split across heads."""
        return V41Pages(entries=tuple(("pages", "page", None) for _ in self.entries),
                        index_keys=tuple(None if keys is None else ("pages", "page", None)
                                         for keys in self.index_keys))

    @staticmethod
    def bytes_per_token(cfg: V41Config, dtype=F32) -> float:
        """Pool bytes a token of context adds (the per-lane rings and buffers are fixed)."""
        per = sum((cfg.head_dim + (cfg.index_head_dim if cfg.owns_index_keys(s) else 0))
                  / cfg.compress_ratios[s] for s in cfg.kv_sources)
        return per * jnp.dtype(dtype).itemsize


@flax.struct.dataclass
class V41Lanes:
    """The fixed-size cache rows of each decode lane: window per layer [lanes, W-1, k] (the last
    W-1 window keys = values, slot = position mod W-1); buf_kv, buf_gate per KV source with r > 1,
    [lanes, r, k]: projections of a group still filling (None for r = 1); engram [lanes,
    max_ngram - 1] int32: the compressed ids of the lane's last positions, the Engram hashes'
    look-back (slot = position mod max_ngram - 1; None without Engram layers).

    The window keys, entries and indexer keys are FP8 / FP4 fake-quantized values, exact in
    bfloat16, so a bfloat16 cache gives the same results at half the memory; the group buffers
    hold raw projections and stay float32."""

    window: tuple
    buf_kv: tuple
    buf_gate: tuple
    engram: jax.Array | None

    @staticmethod
    def create(cfg: V41Config, lanes: int, dtype=F32) -> "V41Lanes":
        def buffer(source):
            ratio = cfg.compress_ratios[source]
            return jnp.zeros((lanes, ratio, cfg.head_dim), F32) if ratio > 1 else None

        return V41Lanes(
            window=tuple(jnp.zeros((lanes, cfg.sliding_window - 1, cfg.head_dim), dtype)
                         for _ in range(cfg.num_layers)),
            buf_kv=tuple(buffer(s) for s in cfg.kv_sources),
            buf_gate=tuple(buffer(s) for s in cfg.kv_sources),
            engram=(jnp.zeros((lanes, cfg.engram_max_ngram - 1), jnp.int32)
                    if cfg.engram_layers else None))


class Compressor(nn.Module):
    """A KV source's compressor: entries for the groups completing in this chunk (pre-RoPE)."""

    cfg: V41Config
    ratio: int
    dtype: jnp.dtype = F32  # of its params

    @nn.compact
    def __call__(self, x, positions, n_valid, buf_kv, buf_gate):
        cfg = self.cfg
        norm = RMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")
        kv = Linear(cfg.head_dim, self.dtype, name="wkv")(x)
        if self.ratio == 1:  # every token is its own group
            return norm(kv), positions, jnp.arange(x.shape[1])[None] < n_valid[:, None], None, None
        gate = Linear(cfg.head_dim, self.dtype, name="wgate")(x)
        start = positions[:, 0]
        latent, group, complete = jax.vmap(pool_groups, (0, 0, 0, 0, 0, 0, None))(
            kv, gate, buf_kv, buf_gate, start, n_valid, self.ratio)
        update = jax.vmap(ring_update)
        buf_kv, buf_gate = update(buf_kv, kv, start, n_valid), update(buf_gate, gate, start, n_valid)
        return norm(latent.astype(x.dtype)), group, complete, buf_kv, buf_gate


class Indexer(nn.Module):
    """Scores queries against a KV group's indexer keys; publishes keys at the KV source."""

    cfg: V41Config
    layer: int
    dtype: jnp.dtype = F32  # of its params

    def setup(self):
        cfg, dt = self.cfg, self.dtype
        self.wq_b = Linear(cfg.index_heads * cfg.index_head_dim, dt)
        self.weights_proj = Linear(cfg.index_heads, dt)
        if cfg.owns_index_keys(self.layer):
            self.wk = Linear(cfg.index_head_dim, dt)
            self.k_norm = RMSNorm(cfg.rms_norm_eps, dt)

    def keys(self, latent, cos, sin):
        """Indexer keys of new compressed latents [b, n, k] -> [b, n, i_k] (rotated, FP4)."""
        k = rope_tail(self.k_norm(self.wk(latent)), cos, sin)
        return fake_quant_fp4(k, 32, e4m3_scale=False)

    def __call__(self, x, q_res, key_pages, block_table, positions, cos, sin, candidates):
        """key_pages [n_pages, rows, i_k]: the KV source's indexer keys in the pool, read through
        block_table [b, P] -> (selected ids [b, t, k] int32, valid [b, t, k] bool, candidate mask
        [b, t, P * rows] or the one given)."""
        cfg = self.cfg
        b, t, _ = x.shape
        ratio = cfg.compress_ratios[self.layer]
        q = self.wq_b(q_res).reshape(b, t, cfg.index_heads, cfg.index_head_dim)
        q = fake_quant_fp4(rope_tail(q, cos, sin), 32, e4m3_scale=False).astype(F32)
        w = self.weights_proj(x).astype(F32) * cfg.index_heads ** -0.5  # [b, t, i]
        visible_count = (positions + 1) // ratio  # [b, t]
        scores = ops.paged_index_scores(q, w, key_pages, block_table, visible_count,
                                        scale=cfg.index_head_dim ** -0.5)
        if self.layer == cfg.candidate_source:
            candidates = jax.vmap(candidate_blocks, (0, 0, None, None))(
                scores, visible_count - 1, cfg.candidate_block_size, cfg.candidate_topk_blocks)
        elif 0 <= cfg.candidate_source < self.layer and candidates is not None:
            scores = jnp.where(candidates, scores, -jnp.inf)
        ids, valid = jax.vmap(top_k_select, (0, None))(scores, cfg.index_topk)
        return ids, valid, candidates


class Attention(nn.Module):
    cfg: V41Config
    layer: int
    dtype: jnp.dtype = F32  # of its params but the sink (float32)

    @nn.compact
    def __call__(self, x, positions, n_valid, window, shared, src_cache, block_table):
        """x [b, t, d] (normed) -> y [b, t, d], window ring, shared (the group state published by
        KV / index sources for the layers that follow: the source's entry and index-key pools
        [n_pages, page_size // r, ...], the selection as top-k ids + valid flags, the candidate
        mask), src_cache (this layer's KV-source pools and group buffers, updated, if it is a
        source); block_table [b, P] each row's pages. Only the selected entries are read from
        the pool, by id through the table."""
        cfg, layer, dt = self.cfg, self.layer, self.dtype
        b, t, _ = x.shape
        h, k = cfg.num_heads, cfg.head_dim
        ratio = cfg.compress_ratios[layer]
        rope = cfg.compress_rope if ratio else cfg.main_rope
        inv_freq, _ = rope_frequencies(rope)
        cos, sin = rope_cos_sin(positions, inv_freq)

        q_res = RMSNorm(cfg.rms_norm_eps, dt, name="q_norm")(
            Linear(cfg.q_lora_rank, dt, name="wq_a")(x))
        q = Linear(h * k, dt, name="wq_b")(q_res).reshape(b, t, h, k)
        q = rope_tail(q, cos, sin)
        kv = RMSNorm(cfg.rms_norm_eps, dt, name="kv_norm")(Linear(k, dt, name="wkv")(x))
        kv = fake_quant_fp8(rope_tail(kv, cos, sin), 32)

        keys, mask, window = window_keys(window, kv, positions, n_valid, cfg.sliding_window)

        picked = valid = None
        if ratio:  # plus the selected compressed entries of the KV group, read by id per query
            shared, src_cache = self._compressed(x, q_res, positions, n_valid, shared, src_cache,
                                                 block_table)
            ids, valid = shared["selection"]
            # [b, t, j, k]
            picked = paged.gather_rows(shared["entries"], block_table, ids).astype(x.dtype)
        p = declare(self, attention_specs(cfg, ATTN_NAMES, dt, dt))
        sink = p["attn_sink"]
        # in the activations' dtype: the keys (FP8 / FP4 values) are exact in bfloat16
        out = attend_with_sink(q.astype(x.dtype), keys.astype(x.dtype), mask, sink, picked, valid)
        out = rope_tail(out, cos, sin, inverse=True).astype(x.dtype)

        low_rank = GroupedLowRank(cfg.o_groups, cfg.o_lora_rank, dt, name="wo_a")(out)
        y = Linear(cfg.hidden_size, dt, name="wo_b")(low_rank)
        return y, window, shared, src_cache

    def _compressed(self, x, q_res, positions, n_valid, shared, src_cache, block_table):
        cfg, layer = self.cfg, self.layer
        ratio = cfg.compress_ratios[layer]
        inv_freq, _ = rope_frequencies(cfg.compress_rope)
        indexer = (Indexer(cfg, layer, self.dtype, name="indexer")
                   if layer in cfg.index_sources else None)
        if layer in cfg.kv_sources:
            entries, index_keys, buf_kv, buf_gate = src_cache
            latent, group, complete, buf_kv, buf_gate = Compressor(cfg, ratio, self.dtype,
                                                                   name="compressor")(
                x, positions, n_valid, buf_kv, buf_gate)
            cos_g, sin_g = rope_cos_sin(group * ratio, inv_freq)
            # entry g of a row goes to row g % (page_size // r) of its page g // (page_size // r)
            slots = paged.token_slots(block_table, group, complete, *entries.shape[:2])
            if index_keys is not None:
                index_keys = paged.write(index_keys, indexer.keys(latent, cos_g, sin_g), slots)
            rotated = fake_quant_fp4(rope_tail(latent, cos_g, sin_g), 16, e4m3_scale=True)
            entries = paged.write(entries, rotated, slots)
            src_cache = (entries, index_keys, buf_kv, buf_gate)
            shared = {"entries": entries, "index_keys": index_keys,
                      "candidates": shared.get("candidates")}
        if indexer is not None:
            cos, sin = rope_cos_sin(positions, inv_freq)
            ids, valid, candidates = indexer(x, q_res, shared["index_keys"], block_table,
                                             positions, cos, sin, shared.get("candidates"))
            shared = {**shared, "selection": (ids, valid), "candidates": candidates}
        return shared, src_cache


def router_spec(cfg: V41Config) -> RouterSpec:
    """sqrtsoftplus scores of logits / gate_temp; the correction bias picks, never weighs. Every
    layer's MoE (layers.moe.MoE, named "ffn") adds one shared expert, clamped as the routed ones
    (swiglu_limit) and computed in float32 as the reference does."""
    return RouterSpec(n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
                      scoring="sqrtsoftplus", temperature=cfg.gate_temp,
                      norm_topk_prob=cfg.norm_topk_prob and cfg.num_experts_per_tok > 1,
                      routed_scaling_factor=cfg.routed_scaling_factor)


def engram_specs(cfg: V41Config, dtype) -> dict:
    """Engram's declared params: wkv (rows -> n keys and a value), the q and k weights [n, d]."""
    d, n = cfg.hidden_size, cfg.hc_mult
    return {"wkv": linear_specs(d * (n + 1), cfg.engram_cols * cfg.engram_head_dim, (None, None),
                                dtype),
            "q_weight": ParamSpec((n, d), dtype, (None, "embed"), init="ones"),
            "k_weight": ParamSpec((n, d), dtype, (None, "embed"), init="ones")}


class Engram(nn.Module):
    """Adds a gated n-gram memory row to every stream. rows [b, t, cols, e]: the layer's table
    rows (engram.gather_rows)."""

    cfg: V41Config
    dtype: jnp.dtype = F32  # of its params (the gate is computed in float32)

    @nn.compact
    def __call__(self, streams, rows):
        cfg, dt = self.cfg, self.dtype
        b, t, n, d = streams.shape
        kv = Linear(d * (n + 1), dt, name="wkv")(rows.reshape(b, t, -1).astype(streams.dtype))
        key = kv[..., :n * d].astype(F32).reshape(b, t, n, d)
        value = kv[..., n * d:].astype(F32)
        p = declare(self, engram_specs(cfg, dt))
        q_w, k_w = p["q_weight"].astype(F32), p["k_weight"].astype(F32)
        hs = streams.astype(F32)
        eps = cfg.rms_norm_eps
        rstd = (jax.lax.rsqrt(jnp.mean(hs * hs, -1) + eps) * jax.lax.rsqrt(jnp.mean(key * key, -1) + eps))
        dot = jnp.sum(hs * (q_w * k_w) * key, -1) * rstd * d ** -0.5
        gate = jax.nn.sigmoid(jnp.sign(dot) * jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)))
        return (hs + gate[..., None] * value[..., None, :]).astype(streams.dtype)


class DecoderLayer(nn.Module):
    cfg: V41Config
    layer: int  # its kind (V41Config.layer_kind): the first layer of a scanned run's block
    serve: ServeOptions
    dtype: jnp.dtype = F32  # of its params but mHC's and the router's (float32)
    moe_index: Any = None  # its MoE's row of the expert state (traced in a scanned run);
    # None: `layer`

    @nn.compact
    def __call__(self, streams, pre, positions, token_mask, n_valid, window, shared, src_cache,
                 block_table, rows, experts, replay=None):
        cfg, dt = self.cfg, self.dtype
        mix = dict(eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters)
        n, d = cfg.hc_mult, cfg.hidden_size

        if rows is not None:
            streams = Engram(cfg, dt, name="engram")(streams, rows)
        # each site collapses its streams by the last site's pre (the layer before's ffn site's,
        # the embedding's [1, 0, ...] at the first layer), not by its own
        pre_a, post_a, comb_a, x = ops.mhc_front(
            streams, *mhc_params(self, "hc_attn", n, d), pre, **mix)
        x = RMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
        y, window, shared, src_cache = Attention(cfg, self.layer, dt, name="attn")(
            x, positions, n_valid, window, shared, src_cache, block_table)
        streams = hc_expand(y, streams, post_a, comb_a)

        pre_f, post_f, comb_f, x = ops.mhc_front(
            streams, *mhc_params(self, "hc_ffn", n, d), pre_a, **mix)
        x = RMSNorm(cfg.rms_norm_eps, dt, name="ffn_norm")(x)
        moe_index = self.layer if self.moe_index is None else self.moe_index
        y, experts = MoE(router_spec(cfg), moe_index, cfg.moe_intermediate_size, self.serve, dt,
                         act_dtype=F32, name="ffn")(x, token_mask, experts, replay=replay)
        streams = hc_expand(y, streams, post_f, comb_f)
        return streams, pre_f, window, shared, src_cache, experts


def scanned_runs(cfg: V41Config, serve: ServeOptions) -> tuple[tuple[int, int, int], ...]:
    """The runs of layers (V41Config.layer_runs) the forward scans, each compiled once: none
    unless `serve.scan_layers`, nor where misses are computed on the host ("cpu", "auto"), whose
    callback takes its layer as a constant."""
    host = serve.miss_policy in ("cpu", "auto") and not serve.all_resident
    return cfg.layer_runs() if serve.scan_layers and not host else ()


class LayerBlock(nn.Module):
    """One block of a scanned run (nn.scan over its repeats): `period` layers of the kinds of
    first..first+period-1, each given its window ring and MoE row; the params of its layer k
    are the run's layers first + j * period + k stacked on a leading axis (weights.stack_runs).
    -> (carry, (windows, and with `keep` each layer's streams and selection, for the sows))."""

    cfg: V41Config
    first: int
    period: int
    serve: ServeOptions
    dtype: jnp.dtype = F32
    keep: bool = False

    @nn.compact
    def __call__(self, carry, per_block, inputs):
        streams, pre, shared, experts = carry
        windows, moe_rows = per_block  # period x [b, W-1, k]; [period] int32
        positions, token_mask, n_valid, block_table, replay = inputs
        windows, kept = list(windows), []
        for k in range(self.period):
            layer = self.first + k
            streams, pre, windows[k], shared, _, experts = DecoderLayer(
                self.cfg, layer, self.serve, self.dtype, moe_rows[k], name=f"layer_{k}")(
                streams, pre, positions, token_mask, n_valid, windows[k], shared, None,
                block_table, None, experts, replay)
            if self.keep:
                kept.append((streams, shared["selection"] if layer in self.cfg.index_sources
                             else None))
        return (streams, pre, shared, experts), (tuple(windows), tuple(kept))


class DeepseekV41(nn.Module):
    cfg: V41Config
    serve: ServeOptions  # how routed experts are served (miss policy) and the ops run (kernel)
    dtype: jnp.dtype = F32  # of the dense params but mHC's, the sinks and the routers (float32)

    @nn.compact
    @serving
    def __call__(self, tokens, positions, token_mask, cache: PagedCache, block_table,
                 experts: ExpertState, engram: EngramTables | None = None, replay=None,
                 logits_at=None, prompt_rows=None):
        """tokens, positions [b, t] int32; token_mask [b, t] bool (real tokens first);
        cache: V41Pages (the shared pool) and V41Lanes (one row per batch row); block_table
        [b, P] int32: each row's pages in the pool;
        experts: the residency state (every layer is a MoE layer, rowmap row = layer);
        engram: the Engram hash maps and tables (None without Engram layers); replay [b, t, layers, k]: recorded picks to route by (None: the routers choose);
        logits_at [b]: the one position of each row to compute logits at (None: all);
        prompt_rows: a prompt chunk's Engram rows read on the host (engram.prompt_rows; None:
        the step reads them, gather_rows)
        -> (logits [b, t or 1, vocab] float32, cache, experts).

        Runs of like layers run under nn.scan (scanned_runs, LayerBlock) where
        `serve.scan_layers` is on (their params stacked: weights.stack_runs).
        Sows "streams" (each layer's output streams) and "selection" (each index source's
        selection) into the "intermediates" collection for parity checks, per layer in order,
        scanned or not."""
        cfg = self.cfg
        b, t = tokens.shape
        n_valid = jnp.sum(token_mask, 1).astype(jnp.int32)
        embedding = declare(self, embedding_specs(cfg.vocab_size, cfg.hidden_size, self.dtype,
                                                  cfg.tie_word_embeddings))
        x = jnp.take(embedding["embed"], tokens, axis=0)
        streams = jnp.broadcast_to(x[:, :, None], (b, t, cfg.hc_mult, cfg.hidden_size))
        pre = jnp.zeros((b, t, cfg.hc_mult), F32).at[..., 0].set(1.0)
        pages, lanes = cache.pages, cache.lanes
        engram_rows, history = None, lanes.engram
        if cfg.engram_layers:
            ids, history = hash_ids(engram, tokens, positions, token_mask, lanes.engram)
            engram_rows = (gather_rows(engram, ids) if prompt_rows is None  # [b, t, layers,
                           else dequantized(prompt_rows, (b, t, ids.shape[-1])))  # cols, e] f32
        windows = list(lanes.window)
        sources = [list(z) for z in zip(pages.entries, pages.index_keys, lanes.buf_kv, lanes.buf_gate)]
        shared: dict = {}
        runs = {first: (period, n) for first, period, n in
                scanned_runs(cfg, self.serve)}
        keep = self.is_mutable_collection("intermediates")
        i = 0
        while i < cfg.num_layers:
            if i in runs:
                period, n = runs[i]
                layers = jnp.arange(i, i + period * n, dtype=jnp.int32).reshape(n, period)
                block = nn.scan(LayerBlock, variable_axes={"params": 0},
                                split_rngs={"params": True}, in_axes=(0, nn.broadcast), length=n)
                (streams, pre, shared, experts), (ring, kept) = block(
                    cfg, i, period, self.serve, self.dtype, keep,
                    name=f"layers_{i}_{i + period * n - 1}")(
                    (streams, pre, shared, experts),
                    (tuple(jnp.stack(windows[i + k:i + period * n:period]) for k in range(period)),
                     layers), (positions, token_mask, n_valid, block_table, replay))
                for j, k in itertools.product(range(n), range(period)):
                    windows[i + j * period + k] = ring[k][j]
                    if keep:
                        self._sow_layer(i + j * period + k, kept[k][0][j], jax.tree.map(
                            lambda a, j=j: a[j], kept[k][1]), block_table, shared)
                i += period * n
                continue
            src = cfg.kv_sources.index(i) if i in cfg.kv_sources else None
            rows = (engram_rows[:, :, cfg.engram_layers.index(i)]
                    if i in cfg.engram_layers else None)
            streams, pre, windows[i], shared, src_cache, experts = DecoderLayer(
                cfg, i, self.serve, self.dtype, name=f"layers_{i}")(
                streams, pre, positions, token_mask, n_valid, windows[i], shared,
                None if src is None else tuple(sources[src]), block_table, rows, experts,
                replay)
            if src is not None:
                sources[src] = list(src_cache)
            self._sow_layer(i, streams, shared.get("selection"), block_table, shared)
            i += 1
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")(hc_collapse(streams, pre))
        head = embedding["embed" if cfg.tie_word_embeddings else "lm_head"]
        logits = lm_logits(x, head, logits_at)
        entries, index_keys, buf_kv, buf_gate = (tuple(z) for z in zip(*sources)) if sources else ((),) * 4
        cache = PagedCache(V41Pages(entries, index_keys),
                           V41Lanes(tuple(windows), buf_kv, buf_gate, history))
        return logits, cache, experts

    def _sow_layer(self, layer: int, streams, selection, block_table, shared) -> None:
        """Layer `layer`'s output streams and, at an index source, its selection as dense
        [b, t, G] masks (parity checks only)."""
        self.sow("intermediates", "streams", streams)
        if layer in self.cfg.index_sources:
            g = block_table.shape[1] * shared["entries"].shape[1]  # P * rows
            self.sow("intermediates", f"selection_{layer}",
                     jax.vmap(selection_mask, (0, 0, None))(*selection, g))
